"""Reading a request into a problem: an input file's tensors checked and completed as an op (or a Keras or PyTorch
module) needs them, with where each parameter came from (``reading``), and the Python API's ``lg.load`` over it
(``inputs``)."""
