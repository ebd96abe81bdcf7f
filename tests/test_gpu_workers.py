"""A batch's local workers on a GPU backend: one visible CUDA device each, in turn (issue 39's several GPUs), tested
without a GPU: the device a worker sees is its CUDA_VISIBLE_DEVICES, and a plugin backend that says it computes on
a GPU (a real entry point, installed on PYTHONPATH) reports the one its process sees."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
from test_batch import CLI_WITH_WORKERS, make_inputs

from lstmgrad_cli.execution import local_workers
from lstmgrad_cli.operations import batch

FAKE_GPU = '''
import os
from lstmgrad_cli.backends import get_backend


class FakeGpu:
    """Says it computes on a GPU (gpu_arrays); computes on the host, and says in its version the device it sees."""

    name = "fakegpu"
    gpu_arrays = True

    @property
    def version(self):
        return "device " + os.environ.get("CUDA_VISIBLE_DEVICES", "unset")

    def block_lstm_grad(self, tensors, **options):
        return get_backend("numpy").block_lstm_grad(tensors, **options)
'''


def install_plugin(folder: Path) -> Path:
    """The fake GPU backend as an installed distribution with its entry point, in ``folder`` (for PYTHONPATH)."""
    folder.mkdir()
    (folder / "fakegpu_plugin.py").write_text(FAKE_GPU)
    info = folder / "fakegpu_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakegpu-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lstmgrad.backends]\nfakegpu = fakegpu_plugin:FakeGpu\n")
    return folder


def device_seen(barrier) -> tuple[int, str]:
    """In a worker: (its pid, the CUDA devices it sees), once every worker is in a task (so each holds one)."""
    barrier.wait(timeout=120)
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "unset")


@pytest.mark.slow
@pytest.mark.parametrize("workers, devices, seen", [(2, ["3", "5"], {"3", "5"}), (3, ["7"], {"7"}),
                                                    (3, ["0", "1"], {"0", "1"})])
def test_each_local_worker_sees_one_of_the_devices_in_turn(workers, devices, seen):
    with multiprocessing.Manager() as manager, local_workers.pool(workers, devices=devices) as (pool, _threads):
        barrier = manager.Barrier(workers)
        found = [f.result(timeout=180) for f in [pool.submit(device_seen, barrier) for _ in range(workers)]]
    assert len({pid for pid, _ in found}) == workers  # one task in each worker
    assert {device for _, device in found} == seen
    if workers == 3 and len(devices) == 2:  # in turn: 0, 1, 0
        assert sorted(device for _, device in found) == ["0", "0", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_on_a_gpu_backend_spreads_its_workers_over_the_visible_devices(tmp_path, method):
    make_inputs(tmp_path / "in")
    plugin = install_plugin(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "3,5"}

    def run(*options):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        out.mkdir()
        done = subprocess.run([*CLI_WITH_WORKERS[method], "seq", str(tmp_path / "in"), "--out-dir", str(out),
                               "--backend", "fakegpu", "--json", *options], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        return [r["backend_version"] for r in json.loads(done.stdout)["results"]]

    assert set(run("--workers", "2")) <= {"device 3", "device 5"}  # each worker one device, never both
    assert set(run()) == {"device 3,5"}  # serial: the process's own devices, as given


def test_only_a_gpu_backend_spreads_workers_over_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 4,")
    assert batch.gpu_devices("cupy") == ["2", "4"]
    assert batch.gpu_devices("numpy") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert batch.gpu_devices("cupy") == []  # none visible: the workers are not told one

