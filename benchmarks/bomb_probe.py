"""Peak memory, time and temporary disk of every crafted input of tests/bombs.py (issue 34) and
tests/hostile_models.py (issue 41), as `lstmgrad seq` and `lstmgrad inspect --json` meet it in a real process.
The promise: each refused in one line or computed right, under 150 MB over the interpreter's own and 10 s, with no
more temporary disk than the output's size.

    .venv/bin/python benchmarks/bomb_probe.py [DIR [bombs|models [CASE ...]]]
    # DIR: a new folder to build the files in (a temporary one); bombs or models: one set; CASE: some of its cases

`inspect` is run on the input, or on the `--weights` file of a case that has one; `batch` runs a `--weights` case
as three inputs with `--workers 2`.  RSS is the kernel's maximum resident set size (``wait4``) of the command's
process, TMP the most its TMPDIR held (sampled every 50 ms).  ``LSTMGRAD_PROBE_SOURCE=DIR`` runs the package in
DIR instead (another checkout's, for a before-and-after table).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bombs  # noqa: E402
import hostile_models  # noqa: E402
from test_bombs import LAUNCHER  # noqa: E402

TIMEOUT = 120  # seconds
SAFETY = 8 << 30  # bytes of address space


def _disk(folder: Path) -> int:
    total = 0
    for top, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:  # (removed meanwhile)
                pass
    return total


def measure(args: list[str], cwd: Path) -> tuple[float, float, int, int | str, str]:
    """(peak RSS in MB, wall seconds, peak bytes in its TMPDIR, exit code or "killed", what it said last: stderr's
    last line or the JSON's error) of ``lstmgrad ARGS`` in a process of its own, under an address-space limit of
    ``SAFETY`` (a probe must not take the machine's memory)."""
    tmp = Path(tempfile.mkdtemp(prefix="probe-tmp-", dir=cwd))
    env = {**os.environ, "NO_COLOR": "1", "TMPDIR": str(tmp)}
    if os.environ.get("LSTMGRAD_PROBE_SOURCE"):
        env["PYTHONPATH"] = os.environ["LSTMGRAD_PROBE_SOURCE"]
    peak_tmp, done = [0], threading.Event()

    def watch_tmp():
        while not done.wait(0.05):
            peak_tmp[0] = max(peak_tmp[0], _disk(tmp))

    watcher = threading.Thread(target=watch_tmp)
    watcher.start()
    report, report_w = os.pipe()
    start = time.perf_counter()
    # started by test_bombs.py's small launcher: a process forked from this one would be charged its size
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(report_w), str(SAFETY), str(TIMEOUT), "0",
                             sys.executable, "-m", "lstmgrad_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=cwd, pass_fds=(report_w,))
    os.close(report_w)
    stdout: list[bytes] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    stderr = proc.stderr.read().decode("utf-8", "replace")
    reader.join()
    proc.wait()
    wall = time.perf_counter() - start
    code, maxrss_kb = (int(v) for v in os.read(report, 100).decode().split())
    os.close(report)
    done.set()
    watcher.join()
    shutil.rmtree(tmp, ignore_errors=True)
    lines = stderr.splitlines()
    tail = lines[-1] if lines else ""
    try:  # inspect --json: its error, or the report's first error
        doc = json.loads(stdout[0])
        errors = [p["message"] for p in doc.get("result", {}).get("problems", []) if p["severity"] == "error"]
        tail = doc.get("error") or (errors[0] if errors else tail)
    except (ValueError, AttributeError, IndexError):
        pass
    if "Traceback" in stderr:
        tail = f"TRACEBACK {tail}"
    elif len(lines) > 1:
        tail = f"[{len(lines)} lines] {tail}"
    return maxrss_kb / 1024, wall, peak_tmp[0], "killed" if code == -9 and wall >= TIMEOUT else code, tail


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="bombs-"))
    sets = {"bombs": lambda: bombs.build_all(root / "in"), "models": lambda: hostile_models.build_all(root / "models")}
    chosen = [sys.argv[2]] if len(sys.argv) > 2 else list(sets)
    only = set(sys.argv[3:])
    cases = {name: case for which in chosen for name, case in sets[which]().items()}
    out = root / "out"
    out.mkdir(exist_ok=True)
    print(f"{'case':38} {'command':8} {'RSS MB':>7} {'s':>6} {'TMP MB':>7} {'exit':>4}  message")
    for name, (path, extra) in cases.items():
        if only and name not in only:
            continue
        commands = ["seq", "inspect", *(["batch"] if "--weights" in extra else [])]
        for command in commands:
            if command == "seq":
                args = ["seq", str(path), *extra, "-o", str(out / "g.npz"), "--force"]
            elif command == "inspect":
                args = ["inspect", extra[extra.index("--weights") + 1] if "--weights" in extra else str(path),
                        "--json"]
            else:
                copies = [out / f"in{k}{path.suffix}" for k in range(3)]
                for copy in copies:
                    shutil.copyfile(path, copy)
                shutil.rmtree(out / "batch", ignore_errors=True)
                args = ["seq", *map(str, copies), *extra, "--out-dir", str(out / "batch"), "--workers", "2"]
            rss, wall, tmp, code, tail = measure(args, out)
            tail = tail.replace(str(root), "")
            print(f"{name:38} {command:8} {rss:7.0f} {wall:6.1f} {tmp / 2**20:7.1f} {code!s:>4}  {tail[:150]}",
                  flush=True)


if __name__ == "__main__":
    main()
