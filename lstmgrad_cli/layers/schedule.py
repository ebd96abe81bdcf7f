"""Which steps of x one LSTM layer direction runs, in which order, and where the outputs it returns come from.

The block-LSTM ops run every example over the same steps 0..T-1 of a time-major x.  A framework's layer may run
each example over its own steps: backwards in time (PyTorch's reverse direction, Keras' go_backwards), only the
first ``lengths[b]`` steps (PyTorch's packed sequences), or only the steps a Keras mask keeps, carrying the state
over the others.  A ``Schedule`` maps that to the op: run step ``s`` of example ``b`` reads x at time
``take[s, b]`` for ``s < steps[b]`` (the steps after are run on zeros and their outputs never used), and the
output the layer returns at position ``p`` (of its output sequence, in the order it returns it) is the op's output
at run step ``source[p, b]``, or zeros where that is -1.  The final states are the op's at run step ``steps[b] - 1``
(the initial state where an example runs no step).

The gradients go the other way: the gradient arriving at output ``p`` is added to the op's ``h_grad`` at
``source[p, b]``, and x's gradient at ``take[s, b]`` is the op's at ``s`` (zero at times no step reads).
Plain schedules (all steps, forwards or backwards) use slices and no index arrays.

A schedule computes where its ``device`` does (device.py): on the host, or, ``placed`` on a GPU backend's device,
on device arrays with the device's array module, its index arrays made on the host and copied there once each.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .device import HOST, Device


@dataclass(frozen=True)
class Schedule:
    T: int
    B: int
    reversed: bool = False  # plain schedules: the layer runs x backwards in time
    outputs_in_run_order: bool = False  # plain schedules: outputs returned in the order run (else x's order)
    take: np.ndarray | None = None  # [T, B] x time read at each run step (None: plain)
    steps: np.ndarray | None = None  # [B] steps each example runs (None: T)
    source: np.ndarray | None = None  # [T, B] run step of each returned output, -1: zeros (None: plain)
    last: np.ndarray | None = None  # [B] run step of the last output the layer returns (its return_sequences=False
    #                                 output), -1: zeros (None: from ``source``)
    mirrored: bool = False  # take is source, and each maps run steps to times as times to run steps (lengths)
    device: Device = HOST  # where the arrays it reorders are (device.py)
    _index: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # name -> index array there

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def plain(cls, T: int, B: int, *, reversed: bool = False, outputs_in_run_order: bool = False,
              last: int | None = None) -> Schedule:
        """Every example runs all T steps (backwards in time: ``reversed``); ``last``: the run step of the output
        a layer returns without return_sequences (default: its last output in the order it returns them)."""
        return cls(T, B, reversed=reversed, outputs_in_run_order=outputs_in_run_order,
                   last=None if last is None or not T else np.full(B, last))

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, T: int, *, reversed: bool = False) -> Schedule:
        """PyTorch's packed sequences: example b runs its first ``lengths[b]`` steps (backwards for the reverse
        direction, from ``lengths[b] - 1`` down to 0); outputs in x's time order, zero past the length."""
        n = np.asarray(lengths, dtype=np.int64)
        B = n.shape[0]
        s = np.arange(T)[:, None]
        valid = s < n[None, :]
        take = np.where(valid, (n[None, :] - 1 - s) if reversed else s, 0)
        source = np.where(valid, take, -1)  # the output at time p comes from the step that read time p
        return cls(T, B, take=take, steps=n, source=source, mirrored=True)

    @classmethod
    def from_mask(cls, mask: np.ndarray, *, backwards: bool = False, outputs_in_x_order: bool = False,
                  zero_output_for_mask: bool = False) -> Schedule:
        """A Keras layer given a mask [B, T]: it iterates over x (backwards with go_backwards, or as a
        Bidirectional's backward layer), runs the cell at the steps the mask keeps and carries state and output
        over the others (or outputs zeros there, ``zero_output_for_mask``).  It returns its outputs in the order it
        iterated, which a Bidirectional turns back into x's order (``outputs_in_x_order``)."""
        m = np.asarray(mask, dtype=bool).T  # [T, B], x's time order
        T, B = m.shape
        iterated = m[::-1] if backwards else m  # [T, B] in the order the layer iterates
        steps = iterated.sum(axis=0)
        times = np.arange(T)[:, None] if not backwards else (T - 1 - np.arange(T))[:, None]
        take = np.zeros((T, B), dtype=np.int64)
        q, b = np.nonzero(iterated)  # (row-major: for each iteration q, the examples it runs)
        order = np.argsort(b, kind="stable")  # group by example, iterations in order
        q, b = q[order], b[order]
        first = np.concatenate([[0], np.cumsum(np.bincount(b, minlength=B))[:-1]])
        s = np.arange(q.size) - first[b]  # the run step each kept iteration is
        take[s, b] = np.broadcast_to(times, (T, B))[q, b]
        ran = np.cumsum(iterated, axis=0) - 1  # the last run step at or before each iteration (-1: none yet)
        if zero_output_for_mask:
            ran = np.where(iterated, ran, -1)
        source = ran[::-1] if outputs_in_x_order and backwards else ran
        return cls(T, B, take=take, steps=steps, source=source, last=ran[-1] if T else np.full(B, -1))

    # -- what it says ------------------------------------------------------------------------------------

    @property
    def plain_order(self) -> bool:
        return self.take is None

    @property
    def seq_len_max(self) -> int:
        """The steps the op must run: the longest example's."""
        return self.T if self.steps is None else int(self.steps.max(initial=0))

    def final_step(self) -> np.ndarray:
        """[B] the run step of each example's final state, -1 where it runs none (the initial state is final)."""
        return np.full(self.B, self.T - 1) if self.steps is None else self.steps - 1

    def last_source(self) -> np.ndarray:
        """[B] the run step of the last output the layer returns (-1: zeros)."""
        if self.last is not None:
            return self.last
        if self.source is not None:
            return self.source[-1] if self.T else np.full(self.B, -1)
        if not self.T:
            return np.full(self.B, -1)
        step = self.T - 1 if (self.outputs_in_run_order or not self.reversed) else 0
        return np.full(self.B, step)

    def placed(self, device: Device) -> Schedule:
        """This schedule reordering arrays on ``device``."""
        return self if device == self.device else replace(self, device=device)

    def _at(self, name: str, make) -> np.ndarray:
        """The index array ``make()`` (made on the host) where the arrays are: copied to the device once."""
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = self.device.put(make())
        return index

    def _columns(self) -> np.ndarray:
        return self._at("columns", lambda: np.arange(self.B))

    # -- forwards: x in, outputs out -------------------------------------------------------------------

    def run_x(self, x: np.ndarray) -> np.ndarray:
        """The op's x [T, B, I]: run order, zeros at steps an example does not run."""
        if self.plain_order:
            return self.device.xp.ascontiguousarray(x[::-1]) if self.reversed else x
        return self._gather(x, "take")

    def outputs(self, h: np.ndarray) -> np.ndarray:
        """The layer's returned output sequence [T, B, C] from the op's ``h`` (run order)."""
        if self.source is None:
            return h[::-1] if self.reversed and not self.outputs_in_run_order else h
        out = h[self._at("source_step", lambda: np.maximum(self.source, 0)), self._columns()]
        out[self._at("source_none", lambda: self.source < 0)] = 0
        return out

    def final(self, h: np.ndarray, initial: np.ndarray) -> np.ndarray:
        """[B, C] the op's ``h`` (or cs) at each example's final step, the initial state where it ran none."""
        if not self.T:
            out = self.device.xp.zeros_like(initial)
        else:
            out = h[self._at("final_step", lambda: np.maximum(self.final_step(), 0)), self._columns()]
        return self.device.xp.where(self._at("final_none", lambda: (self.final_step() < 0)[:, None]), initial, out)

    def last_output(self, h: np.ndarray, initial: np.ndarray) -> np.ndarray:
        """[B, C] the last output the layer returns (its output without return_sequences) from the op's ``h``, in
        ``initial``'s dtype."""
        xp = self.device.xp
        if not self.T:
            return xp.zeros_like(initial)
        out = h[self._at("last_step", lambda: np.maximum(self.last_source(), 0)), self._columns()]
        return xp.where(self._at("last_none", lambda: (self.last_source() < 0)[:, None]), 0, out).astype(initial.dtype)

    # -- backwards: output gradients in, x's gradient out -------------------------------------------------

    def run_h_grad(self, h_grad: np.ndarray | None, last_grad: np.ndarray | None, C: int, dtype) -> np.ndarray:
        """The op's ``h_grad`` [T, B, C] from the gradient at the returned outputs (a sequence [T, B, C] in the
        order returned) and at the last output only ([B, C]); either may be None."""
        out = self.device.xp.zeros((self.T + 1, self.B, C), dtype)  # row T collects what goes to no step (-1)
        cols = self._columns()
        if h_grad is not None and self.mirrored:  # each output is one run step's, and the other way round
            out[:self.T] = self._gather(h_grad, "source")
        elif h_grad is not None:
            if self.source is None:
                out[:self.T] = h_grad[::-1] if self.reversed and not self.outputs_in_run_order else h_grad
            else:
                source = self._at("source", lambda: self.source)
                for p in range(h_grad.shape[0]):  # one example per column: no index repeats within one row
                    out[source[p], cols] += h_grad[p]
        if last_grad is not None:
            out[self._at("last", self.last_source), cols] += last_grad
        return out[:self.T]

    def place_final(self, grad: np.ndarray, final_grad: np.ndarray | None) -> None:
        """Add the gradient at the final state (h_n or c_n) to the op's h_grad or cs_grad at each example's final
        step (``bypass_final`` adds it where an example ran no step)."""
        if final_grad is None:
            return
        ran = self._at("ran", lambda: np.nonzero(self.final_step() >= 0)[0])
        grad[self._at("ran_step", lambda: self.final_step()[self.final_step() >= 0]), ran] += final_grad[ran]

    def bypass_final(self, initial_grad: np.ndarray, final_grad: np.ndarray | None) -> None:
        """Where an example runs no step its final state is its initial one: add the final state's gradient to the
        initial state's (after the backward pass)."""
        if final_grad is not None:
            idle = self._at("idle", lambda: np.nonzero(self.final_step() < 0)[0])
            initial_grad[idle] += final_grad[idle]

    def _gather(self, a: np.ndarray, index: str) -> np.ndarray:
        """``a[index[s, b], b]`` [T, B, ...] (``index``: "take" or "source"), zeros where the run step is not run
        (s >= steps[b]) or the index is -1."""
        def unused():
            at = getattr(self, index)
            return (np.arange(self.T)[:, None] >= self.steps[None, :]) | (at < 0)

        out = a[self._at(f"{index}_step", lambda: np.maximum(getattr(self, index), 0)), self._columns()]
        out[self._at(f"{index}_unused", unused)] = 0
        return out

    def x_grad(self, x_grad: np.ndarray) -> np.ndarray:
        """x's gradient [T, B, I] in x's time order from the op's (run order); zero at times no step read."""
        if self.plain_order:
            return self.device.xp.ascontiguousarray(x_grad[::-1]) if self.reversed else x_grad
        if self.mirrored:
            return self._gather(x_grad, "take")
        out = self.device.xp.zeros_like(x_grad)
        ran = np.nonzero(np.arange(self.T)[:, None] < self.steps[None, :])
        s, b = self._at("ran_s", lambda: ran[0]), self._at("ran_b", lambda: ran[1])
        out[self._at("ran_time", lambda: self.take[ran]), b] = x_grad[s, b]
        return out
