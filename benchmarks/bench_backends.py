"""Time every usable backend on the standard shapes (``make bench``); options as ``lstmgrad bench``.

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (the Makefile does).  To compare with
PyTorch or TensorFlow without making them dependencies, point at an interpreter that has them:

    python benchmarks/bench_backends.py --compare-python /work/torchvenv/bin/python --markdown
"""

import sys

from lstmgrad_cli.cli.bench_cmd import bench_command

if __name__ == "__main__":
    bench_command.main(sys.argv[1:], prog_name="bench_backends.py")
