"""The process a command runs in and the others it starts: stop signals (``interrupts``), the heap kept between
files (``allocator``), local worker processes (``local_workers``) and a Dask cluster (``dask_executor``)."""
