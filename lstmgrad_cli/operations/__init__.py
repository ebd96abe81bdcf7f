"""What each command does, callable from Python with no click: ``grad`` (seq and cell on one file), ``batch`` (many
files, serially, in worker processes or on Dask), ``forward``, ``check``, ``inspect`` (``inspect_dump`` for
TensorFlow debug dumps) and ``bench``.  Each takes a file and its options and returns a result the command line
renders (cli/render.py)."""
