"""`bundle build --weights`: torchvision's published weight files, fetched from a loopback mirror, carried, installed.

download.pytorch.org is not reachable from here: a file made in the test (a real state dict of a tiny
model, saved with torch.save) is served on loopback at the path torchvision's URL would have, named with
its own hash prefix as torchvision names its files. For the bundle, that model is registered in
torchvision's own registry (register_model with a WeightsEnum) in the process that runs the build.
"""

import hashlib
import json
import re
import subprocess
import sys
import tarfile

import pytest

import bundle_kit
from appliance.bundle import weights
from conftest import offline_cmd, run_appliance

# Runs `appliance` with a tiny model registered in torchvision's registry, its weights at URL (argv[1]).
REGISTERED = """
import sys
from typing import Optional
from torchvision.models._api import Weights, WeightsEnum, register_model

class TinyNet_Weights(WeightsEnum):
    TEST_V1 = Weights(url=sys.argv.pop(1), transforms=None, meta={"categories": ["a", "b", "c"]})
    DEFAULT = TEST_V1

@register_model("tinynet")
def tinynet(*, weights: Optional[TinyNet_Weights] = None, **kwargs):
    raise NotImplementedError

from appliance.cli import main
sys.exit(main(sys.argv[1:]))
"""


def tiny_state_dict(path):
    """A real state dict (conv, batch norm, linear) saved as torchvision saves its files; its sha256."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 3))
    torch.save(model.state_dict(), path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A loopback mirror of download.pytorch.org holding models/tinynet-<sha256[:8]>.pth."""
    root = tmp_path_factory.mktemp("mirror")
    (root / "models").mkdir()
    made = root / "made.pth"
    digest = tiny_state_dict(made)
    name = f"tinynet-{digest[:8]}.pth"
    made.rename(root / "models" / name)
    with bundle_kit.Served(root) as served:
        yield {"served": served, "root": root, "file": name, "sha256": digest,
               "url": f"https://download.pytorch.org/models/{name}"}


def published(url, prefix):
    return weights.PublishedWeights("tinynet", "TinyNet_Weights.TEST_V1", url, prefix, 3)


def test_the_registry_gives_torchvisions_url_and_the_hash_prefix_torch_hub_checks():
    import torch.hub

    assert weights.HASH_REGEX.pattern == torch.hub.HASH_REGEX.pattern
    r18 = weights.resolve("resnet18")
    assert (r18.url, r18.hash_prefix, r18.weights, r18.num_classes) == (
        "https://download.pytorch.org/models/resnet18-f37072fd.pth", "f37072fd", "ResNet18_Weights.IMAGENET1K_V1",
        1000)
    assert weights.resolve("resnet50:IMAGENET1K_V2").weights == "ResNet50_Weights.IMAGENET1K_V2"
    assert weights.mirror_url(r18.url, "http://mirror.example/pytorch/") == (
        "http://mirror.example/pytorch/models/resnet18-f37072fd.pth")


def test_fetch_checks_the_published_prefix_keeps_the_sha256_and_reuses_a_verified_cache(mirror, tmp_path, capsys):
    entry = published(mirror["url"], mirror["file"].split("-")[1][:8])
    got = weights.fetch(entry, tmp_path / "cache", mirror["served"].url)
    assert got.path == tmp_path / "cache" / mirror["file"] and got.sha256 == mirror["sha256"]
    assert got.fetched_from == f"{mirror['served'].url}/models/{mirror['file']}"
    index = got.index_entry()
    assert index["url"] == mirror["url"] and index["sha256"] == mirror["sha256"] and index["num_classes"] == 3
    # Off a terminal, progress is plain lines with the rate (the last one says it is done).
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"bundle: weights {mirror['file']}: \S+/\S+ B \(100\.0 %\), \S+ B/s, done in \d+ s", line), line

    requests = mirror["served"].log().count(f"GET /models/{mirror['file']}")
    again = weights.fetch(entry, tmp_path / "cache", mirror["served"].url)
    assert again.sha256 == mirror["sha256"] and "from the cache" in capsys.readouterr().err
    assert mirror["served"].log().count(f"GET /models/{mirror['file']}") == requests

    # A damaged cache entry is fetched again, not trusted.
    got.path.write_bytes(b"damaged")
    assert weights.fetch(entry, tmp_path / "cache", mirror["served"].url).sha256 == mirror["sha256"]


def test_a_file_whose_sha256_does_not_match_the_published_prefix_is_refused_in_one_line(mirror, tmp_path):
    wrong = "0" * 8 if not mirror["sha256"].startswith("0" * 8) else "1" * 8
    (mirror["root"] / "models" / f"tinynet-{wrong}.pth").write_bytes((mirror["root"] / "models" / mirror["file"])
                                                                     .read_bytes())
    url = f"https://download.pytorch.org/models/tinynet-{wrong}.pth"
    with pytest.raises(weights.WeightsError) as err:
        weights.fetch(published(url, wrong), tmp_path / "cache", mirror["served"].url)
    assert str(err.value) == (f"{mirror['served'].url}/models/tinynet-{wrong}.pth: sha256 {mirror['sha256'][:16]}... "
                              f"does not start with {wrong}, the hash torchvision publishes for "
                              "TinyNet_Weights.TEST_V1; refusing the file")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the file nor a partial download is kept

    with pytest.raises(weights.WeightsError, match=r"^http://127\.0\.0\.1:\d+/models/absent-12345678\.pth: HTTP 404 "):
        weights.fetch(published("https://download.pytorch.org/models/absent-12345678.pth", "12345678"),
                      tmp_path / "cache", mirror["served"].url)


def test_an_unknown_name_is_one_line_listing_the_names_available(tmp_path):
    proc = bundle_kit.build(tmp_path / "out", "--profile", "test", "--weights", "resnet18,no_such_net",
                            cache=tmp_path / "cache")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()  # before any download: nothing else was printed
    assert line.startswith("appliance bundle build: error: --weights no_such_net: torchvision has no model "
                           "'no_such_net' with published weights (available: alexnet, ")
    assert ", mobilenet_v2, " in line and ", resnet18, " in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def weights_bundle(mirror, tmp_path_factory):
    """A signed test-profile bundle carrying tinynet's weights, fetched from the loopback mirror."""
    base = tmp_path_factory.getbasetemp() / "bundles"
    base.mkdir(exist_ok=True)
    key, _ = bundle_kit.keys(base)
    src = bundle_kit.source_copy(tmp_path_factory.mktemp("src-weights"), "0.1.0")
    out = tmp_path_factory.mktemp("weights-bundle")
    env = {**bundle_kit.user_env(), "APPLIANCE_WEIGHTS_MIRROR": mirror["served"].url}
    proc = subprocess.run([sys.executable, "-c", REGISTERED, mirror["url"], "bundle", "build", "--profile", "test",
                           "--weights", "tinynet", "--out", str(out), "--cache", str(base / "cache"),
                           "--sign-key", str(key), "--source", str(src)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return out / "appliance-bundle-0.1.0.tar"


def test_the_bundle_carries_the_file_with_its_sha256_in_sums_index_and_a_valid_sbom(weights_bundle, mirror):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    with tarfile.open(weights_bundle) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        files = {m.name[len(top) + 1:]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert hashlib.sha256(files[f"weights/{mirror['file']}"]).hexdigest() == mirror["sha256"]
    sums = dict(reversed(line.split("  ", 1)) for line in files["SHA256SUMS"].decode().splitlines())
    assert sums[f"weights/{mirror['file']}"] == mirror["sha256"]
    assert sums["weights/index.json"] == hashlib.sha256(files["weights/index.json"]).hexdigest()
    index = json.loads(files["weights/index.json"])
    assert index == {"tinynet": {"file": mirror["file"], "sha256": mirror["sha256"],
                                 "bytes": len(files[f"weights/{mirror['file']}"]), "url": mirror["url"],
                                 "weights": "TinyNet_Weights.TEST_V1", "num_classes": 3,
                                 "fetched_from": f"{mirror['served'].url}/models/{mirror['file']}"}}
    manifest = json.loads(files["bundle.json"])
    assert manifest["weights"] == index and manifest["made_by"].endswith("--profile test --weights tinynet")
    for python in ("3.11", "3.12"):
        text = files[f"profiles/test/py{python}/sbom.cdx.json"].decode()
        assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
        sbom = json.loads(text)
        (model,) = [c for c in sbom["components"] if c["type"] == "machine-learning-model"]
        assert model["name"] == "tinynet" and model["version"] == "TEST_V1"
        assert model["hashes"] == [{"alg": "SHA-256", "content": mirror["sha256"]}]
        assert model["externalReferences"][0]["type"] == "distribution"
        assert model["externalReferences"][0]["url"] == mirror["url"]
        root = sbom["metadata"]["component"]["bom-ref"]
        assert model["bom-ref"] in next(d["dependsOn"] for d in sbom["dependencies"] if d["ref"] == root)
    # `bundle audit` counts packages; the weights are not one.
    audit = run_appliance("bundle", "audit", str(weights_bundle), offline=True, timeout=120)
    assert audit.returncode in (0, 1), audit.stderr
    assert "  profile test, CPython 3.11: 8 packages" in audit.stdout


def test_installed_offline_the_venvs_find_weights_finds_and_verifies_the_file(weights_bundle, mirror, tmp_path,
                                                                              tmp_path_factory):
    prefix = tmp_path / "opt"
    proc = bundle_kit.install(weights_bundle, prefix, pubkey=bundle_kit.public_key(tmp_path_factory))
    assert proc.returncode == 0, proc.stderr
    release = (prefix / "current").resolve()
    placed = release / "weights" / mirror["file"]
    record = json.loads((release / "install.json").read_text())
    assert record["weights"] == {"tinynet": mirror["file"]}
    assert record["self_test"][-1] == "pretrained weights found and verified: tinynet"
    doctor = json.loads((release / "doctor.json").read_text())  # the install's doctor report lists them
    assert doctor["pretrained"]["models"]["tinynet"] == {"file": str(placed), "weights": "TinyNet_Weights.TEST_V1",
                                                         "bytes": placed.stat().st_size, "num_classes": 3}

    code = ("from appliance.assets.weights import find_weights; f = find_weights('tinynet'); "
            "print(f.path, f.sha256, f.url, f.weights)")
    python = str(prefix / "current" / "venv" / "bin" / "python")
    env = {k: v for k, v in bundle_kit.user_env().items() if k != "APPLIANCE_WEIGHTS_DIR"}
    proc = subprocess.run(offline_cmd([python, "-c", code]), capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path, *rest = proc.stdout.split()
    assert path == str(prefix / "current" / "weights" / mirror["file"])  # beside the venv that runs it
    assert rest == [mirror["sha256"], mirror["url"], "TinyNet_Weights.TEST_V1"]

    table = bundle_kit.installed(prefix, "doctor")
    assert f"Pretrained       tinynet (TinyNet_Weights.TEST_V1, {placed.stat().st_size / 1e6:.1f} MB)" in table.stdout

    # A damaged file is refused in one line by the same lookup training uses; a missing name says what adds it.
    placed.chmod(0o644)
    data = placed.read_bytes()
    placed.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    code = ("import sys; from appliance.core.errors import ApplianceError; from appliance.assets.weights import find_weights\n"
            "for name in ('tinynet', 'resnet18'):\n"
            "    try: find_weights(name)\n"
            "    except ApplianceError as err: print(err)\n")
    proc = subprocess.run(offline_cmd([python, "-c", code]), capture_output=True, text=True, env=env, cwd=tmp_path)
    damaged, absent = proc.stdout.strip().splitlines()
    assert damaged.startswith(f"{path}: sha256 ") and damaged.endswith("; the file is damaged")
    assert absent.startswith("torchvision:resnet18: no such pretrained weights in this install (looked in ")
    assert absent.endswith("build the bundle with `appliance bundle build --weights resnet18` to carry them")


def test_an_index_naming_a_file_outside_sha256sums_is_refused_by_the_installer(weights_bundle, tmp_path,
                                                                              tmp_path_factory):
    def change(name, data):
        if name.endswith("/weights/index.json"):
            index = json.loads(data)
            index["tinynet"]["file"] = "../venv/evil.pth"
            return json.dumps(index).encode()
        return data

    tar = bundle_kit.rewrite_tar(weights_bundle, tmp_path / "b.tar", change=change)
    with tarfile.open(tar) as t:
        top = t.getmembers()[0].name.split("/")[0]
        index = t.extractfile(f"{top}/weights/index.json").read()
    # As an attacker who also rewrote SHA256SUMS would (unsigned, so only the sums stand in the way).
    sums_fixed = bundle_kit.rewrite_tar(tar, tmp_path / "c.tar", change=lambda name, data: re.sub(
        rb"[0-9a-f]{64}  weights/index\.json", hashlib.sha256(index).hexdigest().encode() + b"  weights/index.json",
        data) if name.endswith("/SHA256SUMS") else data)
    proc = bundle_kit.install(sums_fixed, tmp_path / "p", "--allow-unsigned")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "refused: weights/index.json: tinynet names ../venv/evil.pth, which is not a file of the bundle")
