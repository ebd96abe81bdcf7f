"""Where a batch's files run besides the command's own process: local worker processes (how they start, and how a
signal stops them) or the workers of a Dask cluster."""
