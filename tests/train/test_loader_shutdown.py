"""A loader worker that does not leave when the run finishes is killed, not left behind (issue 43,
the teardown hang): torch's _shutdown_workers escalates to SIGTERM, which our workers ignore by design
(a Ctrl-C must not kill them before the trainer saves), so a stuck or starved worker outlived its rank,
orphaned in whatever wait it was in, holding the launcher's pipes."""

import time

import torch

from appliance.train import data
from appliance.train.loop import shut_down_workers


class StuckAfterFirst(torch.utils.data.Dataset):
    """Item 0 at once; any other item never returns (a worker stuck in a wait)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index:
            time.sleep(3600)
        return torch.zeros(1)


def test_a_stuck_loader_worker_is_killed_at_shutdown():
    loader = data._Loader(StuckAfterFirst(), batch_size=1, num_workers=1, persistent_workers=True,
                          prefetch_factor=2, worker_init_fn=data._worker_ignores_stop_signals)
    batches = iter(loader)
    next(batches)  # the worker now sits in item 1 or 2, with SIGTERM ignored
    [worker] = loader._iterator._workers
    start = time.monotonic()
    try:
        shut_down_workers(loader)
        assert not worker.is_alive() and worker.exitcode is not None
        assert time.monotonic() - start < 60
    finally:
        if worker.is_alive():  # the old behaviour: left alive, it would also hang pytest's exit (daemon join)
            worker.kill()
            worker.join()
