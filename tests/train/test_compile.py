"""[train] compile (issue 27): torch.compile of the model, off unless asked ("auto" is off: on a
CPU its compile costs more start-up than a short run's steps save, and no GPU has measured it yet);
a compiled model keeps its state_dict form, trains, and resumes exactly; the run's manifest and
training hash record it. "cuda-graphs" replays the compiled kernels as CUDA graphs where that is
safe (one CUDA process, no gradient accumulation) and runs as "on" elsewhere, saying why."""

import json

import pytest
import torch

from appliance.core.errors import ConfigError
from appliance.train.config import load_config
from appliance.train.ddp import build_training_model, cuda_graphs, use_compile
from appliance.train.loop import write_run_manifest
from appliance.train.optimizer import build_optimizer
from train_data import make_config


def test_compile_is_off_unless_asked_and_a_bad_value_is_one_line(tmp_path):
    cfg = load_config(make_config(tmp_path))
    assert cfg.train.compile == "auto"
    assert not use_compile("auto", torch.device("cpu")) and not use_compile("off", torch.device("cpu"))
    assert use_compile("on", torch.device("cpu")) and use_compile("cuda-graphs", torch.device("cpu"))
    with pytest.raises(ConfigError) as err:
        load_config(make_config(tmp_path, name="bad", train={"compile": "yes"}))
    assert str(err.value).endswith("[train] compile 'yes' is not one of auto, on, off, cuda-graphs")


def test_only_compiling_changes_the_training_hash(tmp_path):
    hashes = {mode: load_config(make_config(tmp_path, name=f"c-{mode}", train={"compile": mode})).training_hash()
              for mode in ("auto", "off", "on", "cuda-graphs")}
    plain = load_config(make_config(tmp_path, name="c-plain")).training_hash()  # no key: a run made before it
    assert hashes["auto"] == hashes["off"] == plain != hashes["on"]
    assert hashes["cuda-graphs"] == hashes["on"]  # the same kernels, replayed: a run may resume under either


def test_cuda_graphs_only_where_they_are_safe_and_otherwise_a_reason():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cuda_graphs("cuda-graphs", cuda, world=1, grad_accum=1) == (True, "")
    for requested in ("on", "off", "auto"):
        assert cuda_graphs(requested, cuda, world=1, grad_accum=1) == (False, "")
    assert cuda_graphs("cuda-graphs", cpu, world=1, grad_accum=1) == (False, "no CUDA device")
    graphs, why = cuda_graphs("cuda-graphs", cuda, world=1, grad_accum=4)
    assert not graphs and why.startswith("grad_accum = 4: ") and "pytorch/pytorch#169545" in why
    assert cuda_graphs("cuda-graphs", cuda, world=8, grad_accum=1) == (False, "8 processes: measured with one only")


def test_cuda_graphs_on_a_cpu_compile_the_model_as_on_and_say_so(tmp_path):
    cfg = load_config(make_config(tmp_path, train={"compile": "cuda-graphs"}))
    lines = []
    model = build_training_model(cfg, torch.device("cpu"), log=lines.append, world=1)[0]
    assert model._compiled_call_impl is not None  # compiled lazily: nothing is compiled until it runs
    assert lines == ["train: [train] compile = 'cuda-graphs' runs as 'on', without CUDA graphs (no CUDA device)"]


def test_full_batches_run_the_static_graph_after_an_epochs_partial_last_batch(tmp_path, monkeypatch):
    # torch.compile's default recompiles at the first other batch size with the size dynamic, and runs
    # every later full batch on that graph: kernels (and their rounding) would change from the first
    # epoch's end, and a run resumed after it (compiling afresh, static) would not continue the same
    # arithmetic. Our compile keeps a graph per shape. Dynamo runs for real; its backend only records
    # which graph ran (inductor would take minutes here and shows nothing more).
    ran, real_compile = [], torch.compile

    def recording_compile(fn, *args, **kwargs):
        def backend(gm, inputs):
            dynamic = any(isinstance(x, torch.SymInt) for x in inputs) or any(
                isinstance(size, torch.SymInt) for x in inputs if isinstance(x, torch.Tensor) for size in x.shape)
            number = len({n for n, _ in ran})

            def run(*a):
                ran.append((number, dynamic))
                return gm.forward(*a)
            return run
        return real_compile(fn, *args, **{**kwargs, "mode": None, "backend": backend})

    monkeypatch.setattr(torch, "compile", recording_compile)
    torch._dynamo.reset()
    cfg = load_config(make_config(tmp_path, train={"compile": "on"}))
    model = build_training_model(cfg, torch.device("cpu"), log=lambda *a, **k: None, world=1)[0]
    for n in (4, 4, 3, 4, 5):
        model(torch.randn(n, 1, 16, 16))
    torch._dynamo.reset()
    assert [dynamic for _, dynamic in ran] == [False] * 5, ran  # every graph static, one per size
    assert [number for number, _ in ran][3] == ran[0][0]  # the full batch after the partial one: the first graph


def _steps(model, optimizer, batches):
    for images, labels in batches:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_a_compiled_model_trains_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    cfg = load_config(make_config(tmp_path, train={"compile": "on", "batch_size": 4}))
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(1)

    def batch(n):
        return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)

    # An epoch's partial last batch (3 of 4), then the next epoch; the resume point is just after it.
    batches = [batch(4), batch(4), batch(3), batch(4), batch(4)]

    def fresh():
        torch._dynamo.reset()  # each run compiles from nothing, as a process (a resumed run's) does
        torch.manual_seed(0)
        model = build_training_model(cfg, device, log=lambda *a, **k: None, world=1)[0]
        return model, build_optimizer(cfg, model, fused=True)

    straight, straight_opt = fresh()
    eager = load_config(make_config(tmp_path, name="eager"))
    torch.manual_seed(0)
    eager_model = build_training_model(eager, device, log=lambda *a, **k: None, world=1)[0]
    assert list(straight.state_dict()) == list(eager_model.state_dict())  # checkpoints keep their form
    assert straight._compiled_call_impl is not None and eager_model._compiled_call_impl is None
    _steps(straight, straight_opt, batches)

    first, first_opt = fresh()
    _steps(first, first_opt, batches[:3])
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = first_opt.state_dict()
    resumed, resumed_opt = fresh()
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    _steps(resumed, resumed_opt, batches[3:])
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # bit for bit, as an eager run resumes
    eager_opt = build_optimizer(eager, eager_model, fused=True)
    _steps(eager_model, eager_opt, batches)
    for a, b in zip(straight.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # the same training, other rounding


def test_the_run_manifest_says_whether_the_model_was_compiled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(make_config(tmp_path))
    (cfg.run_dir / "model").mkdir(parents=True)
    (cfg.run_dir / "model" / "weights.bin").write_bytes(b"0")
    for compiled, graphs in ((True, True), (True, False), (False, False)):
        write_run_manifest(cfg, cfg.run_dir, 3, compiled=compiled, cuda_graphs=graphs)
        params = json.loads((cfg.run_dir / "manifest.json").read_text())["params"]
        assert params["compile"] is compiled and params["cuda_graphs"] is graphs
