"""Peak memory and time of every crafted input of tests/bombs.py, as `lstmgrad seq` and `lstmgrad inspect` meet
it in a real process (GNU time's maximum resident set size).  Issue 34's promise: each refused in one line,
under 150 MB and 5 s.

    .venv/bin/python benchmarks/bomb_probe.py [DIR]      # DIR: where to build the files (a temporary one)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bombs  # noqa: E402

TIMEOUT = 120  # seconds
SAFETY = 8 << 30  # bytes of address space


def measure(args: list[str], cwd: Path) -> tuple[float, float, int | str, str]:
    """(peak RSS in MB, wall seconds, exit code or "timeout", stderr's last line) of ``lstmgrad ARGS`` in a process
    of its own, under an address-space limit of ``SAFETY`` (a probe must not take the machine's memory)."""
    env = {**os.environ, "NO_COLOR": "1"}

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (SAFETY, SAFETY))

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lstmgrad_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=cwd, preexec_fn=limit)
    timer = threading.Timer(TIMEOUT, proc.kill)
    timer.start()
    stdout: list[bytes] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    stderr = proc.stderr.read().decode("utf-8", "replace")
    reader.join()
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    lines = stderr.splitlines()
    errors = [line for line in stdout[0].decode("utf-8", "replace").splitlines() if line.startswith("error")]
    tail = lines[-1] if lines else (errors[0] if errors else "")
    if len(lines) > 1:
        tail = f"[{len(lines)} lines] {tail}"
    code = "killed" if proc.returncode == -9 and wall >= TIMEOUT else proc.returncode
    return usage.ru_maxrss / 1024, wall, code, tail


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="bombs-"))
    cases = bombs.build_all(root / "in")
    out = root / "out"
    out.mkdir(exist_ok=True)
    print(f"{'case':32} {'command':8} {'RSS MB':>7} {'s':>6} {'exit':>4}  message")
    for name, (path, extra) in cases.items():
        for command in ("seq", "inspect"):
            args = [command, str(path), *extra] if command == "seq" else [command, str(extra[1] if extra else path)]
            if command == "seq":
                args += ["-o", str(out / "g.npz"), "--force"]
            rss, wall, code, tail = measure(args, out)
            tail = tail.replace(str(root), "")
            print(f"{name:32} {command:8} {rss:7.0f} {wall:6.1f} {code!s:>4}  {tail[:150]}", flush=True)


if __name__ == "__main__":
    main()
