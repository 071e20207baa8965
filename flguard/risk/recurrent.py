"""Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) in plain operators, step by step over the sequence, and
the cell modules' steps (``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell``) with the same cells.

PyTorch runs a recurrent layer as one call (``torch._VF.rnn_tanh``, ``rnn_relu``, ``gru``, ``lstm``) whose kernel
writes each step's state in place: under ``vmap`` — the guard's per-sample products — it fails ("output with shape
[1, 16] doesn't match the broadcast shape [3, 1, 16]"), so every step of a model with one was withheld. The guard's
forward pass (``flguard.risk.functional``) runs the same recurrences as PyTorch documents them instead, each the same
function to float rounding, for every layer, direction and the LSTM's projection:

* RNN: h' = act(W_ih x + b_ih + W_hh h + b_hh), act tanh or ReLU;
* GRU: r = σ(W_ir x + b_ir + W_hr h + b_hr), z = σ(W_iz x + b_iz + W_hz h + b_hz),
  n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)), h' = (1 − z) ⊙ n + z ⊙ h;
* LSTM: i, f, g, o = σ, σ, tanh, σ of W_ih x + b_ih + W_hh h + b_hh (in that order), c' = f ⊙ c + i ⊙ g,
  h' = o ⊙ tanh(c') (times W_hr with ``proj_size``).

Between stacked layers a training layer drops its output with probability ``dropout``, as PyTorch does — here through
``drop`` (``flguard.risk.dropout_draws``: recorded in the user's pass, replayed in the guard's), on the time-major
(T, N, ·) output, whose batch is its second dimension. Packed sequences (``nn.utils.rnn.PackedSequence``) are left to
PyTorch. Checked against PyTorch's own layers' dense float64 Jacobians in ``tests/test_guard_layers.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

#: (tensor, p) ↦ the tensor dropped with probability p (``flguard.risk.dropout_draws``'s, which draws or replays).
Drop = Callable[[torch.Tensor, float], torch.Tensor]


# Each cell takes one step's input projection W_ih x + b_ih (made for the whole sequence at once), the state, and the
# recurrent weights.

def _rnn_cell(act: Callable[[torch.Tensor], torch.Tensor]):
    def cell(projected: torch.Tensor, state: tuple, w_hh: torch.Tensor, b_hh, w_hr) -> tuple:
        (h,) = state
        return (act(projected + _affine(h, w_hh, b_hh)),)
    return cell


def _gru_cell(projected: torch.Tensor, state: tuple, w_hh: torch.Tensor, b_hh, w_hr) -> tuple:
    (h,) = state
    xr, xz, xn = projected.chunk(3, -1)
    hr, hz, hn = _affine(h, w_hh, b_hh).chunk(3, -1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return ((1 - z) * n + z * h,)


def _lstm_cell(projected: torch.Tensor, state: tuple, w_hh: torch.Tensor, b_hh, w_hr) -> tuple:
    h, c = state
    i, f, g, o = (projected + _affine(h, w_hh, b_hh)).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else F.linear(h, w_hr), c)


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W x + b as ``F.linear`` on a batch-first input (a state [N, H]): the batched K product's fully connected layer
    (``flguard.risk.ghost_forward``), a recurrent weight one layer used at every step."""
    return F.linear(x, weight, bias)


def _projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W_ih x + b_ih for a whole time-major sequence (T, N, features) at once, batch first inside (``_affine``)."""
    return _affine(x.transpose(0, 1), weight, bias).transpose(0, 1)


#: The recurrent functions rewritten, with their cell.
CELLS = {torch._VF.rnn_tanh: _rnn_cell(torch.tanh), torch._VF.rnn_relu: _rnn_cell(torch.relu),
         torch._VF.gru: _gru_cell, torch._VF.lstm: _lstm_cell}


#: One step of the cell modules (``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell``, in the user's own loop over a
#: sequence), with the same cells: their kernels fail under ``vmap`` as the layers' do.
STEP_CELLS = {torch._VF.rnn_tanh_cell: CELLS[torch._VF.rnn_tanh], torch._VF.rnn_relu_cell: CELLS[torch._VF.rnn_relu],
              torch._VF.gru_cell: _gru_cell, torch._VF.lstm_cell: _lstm_cell}


def recurrent_step(func: Any, args: tuple, kwargs: dict) -> tuple | torch.Tensor:
    """``func`` (one of ``STEP_CELLS``: a cell module's step, ``(input, hx, w_ih, w_hh, b_ih, b_hh)``) in plain
    operators: the LSTM's (h', c'), the others' h', as PyTorch's."""
    given = {**dict(zip(("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), args)), **kwargs}
    projected = _affine(given["input"], given["w_ih"], given.get("b_ih"))
    lstm = func is torch._VF.lstm_cell
    state = tuple(given["hx"]) if lstm else (given["hx"],)
    out = STEP_CELLS[func](projected, state, given["w_hh"], given.get("b_hh"), None)
    return out if lstm else out[0]


#: Why a packed sequence is not measured (``recurrent`` leaves it to PyTorch, whose kernel fails in the guard's passes).
PACKED = ("a recurrent layer on a packed sequence (nn.utils.rnn.pack_padded_sequence): the guard runs recurrent layers "
          "step by step on padded batches — give the layer the padded batch (and take each sample's last valid step "
          "from its output)")


def packed(args: tuple) -> bool:
    """Whether a recurrent function's arguments are the packed form (data, batch_sizes, hx, params, …)."""
    return not (len(args) > 3 and isinstance(args[3], bool))


def drops_between_layers(args: tuple) -> bool:
    """Whether a recurrent call (either form) is a training stack that drops between its layers."""
    at = 5 if packed(args) else 4  # num_layers, then dropout and train
    return len(args) > at + 2 and args[at] > 1 and args[at + 1] > 0 and bool(args[at + 2])


def recurrent(func: Any, args: tuple, kwargs: dict, drop: Drop | None) -> tuple | None:
    """``func`` (one of ``CELLS``) on a padded batch in plain operators: (output, h_n) or, for the LSTM,
    (output, h_n, c_n), as PyTorch's; None for a packed sequence, or for a training layer that drops between its
    layers without ``drop`` (PyTorch's own then runs)."""
    if kwargs or len(args) != 9 or packed(args):
        return None
    inputs, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if dropout > 0 and train and num_layers > 1 and drop is None:
        return None
    cell, lstm = CELLS[func], func is torch._VF.lstm
    states = list(zip(*hx)) if lstm else [(h,) for h in hx]  # per layer and direction: (h,) or (h, c)
    directions = 2 if bidirectional else 1
    stride = len(params) // (num_layers * directions)  # w_ih, w_hh, [b_ih, b_hh], [w_hr]
    x = inputs.transpose(0, 1) if batch_first else inputs  # (T, N, features)
    finals = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            at = layer * directions + direction
            weights = list(params[at * stride:(at + 1) * stride])
            w_ih, w_hh = weights[:2]
            b_ih, b_hh = weights[2:4] if has_biases else (None, None)
            w_hr = weights[-1] if stride - 2 - 2 * has_biases == 1 else None
            state, steps, projected = states[at], [None] * x.shape[0], _projection(x, w_ih, b_ih)
            order = range(x.shape[0]) if direction == 0 else reversed(range(x.shape[0]))
            for t in order:
                state = cell(projected[t], state, w_hh, b_hh, w_hr)
                steps[t] = state[0]
            outputs.append(torch.stack(steps))
            finals.append(state)
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout > 0 and train and layer < num_layers - 1:
            x = drop(x, dropout)
    output = x.transpose(0, 1) if batch_first else x
    h_n = torch.stack([state[0] for state in finals])
    return (output, h_n, torch.stack([state[1] for state in finals])) if lstm else (output, h_n)


__all__ = ["CELLS", "PACKED", "STEP_CELLS", "drops_between_layers", "packed", "recurrent", "recurrent_step"]
