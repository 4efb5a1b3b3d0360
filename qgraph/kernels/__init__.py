"""The custom ops' kernels, one job per module.

* ``ops``: the ``qgraph::`` custom ops (delta rule, states, packed attention, markers) with their fakes;
* ``delta_states``: the chunked gated delta rule that also returns the state after each token;
* ``native``: the all-token states' C kernel (``states.c``), compiled at first use, for CPU inference;
* ``buffers``: huge-page memory for the big states buffers, and the pool that reuses it;
* ``grad``: the ops' autograd (backwards that recompute the forward);
* ``delta_reads`` and ``read_ops``: a DeltaNet block read as attention, and its editable writes;
* ``experts``: ``qgraph::moe_experts`` and its kin (MoE programs call them);
* ``slot``: ``qgraph::edit_slot`` (saved programs call it);
* ``qsa``: ``qgraph::qsa_blocks`` and ``qgraph::qsa_select``, sparse attention's token selection (qwen4_exp
  programs call them).

Importing any of them imports this package first, which imports ``grad`` (and with it ``ops``),
``experts``, ``slot`` and ``read_ops``: every ``qgraph::`` op, with its autograd, is registered before a program
that calls one is built, run or loaded (``import qgraph`` alone imports none of them).
"""
from . import grad  # noqa: F401  (imports ops: the ops and their autograd)
from . import experts  # noqa: F401  (qgraph::moe_experts, which MoE programs call)
from . import slot  # noqa: F401  (qgraph::edit_slot, which saved programs call)
from . import read_ops  # noqa: F401  (qgraph::delta_rule_attention and the writes kernel)
from . import qsa  # noqa: F401  (qgraph::qsa_blocks and qsa_select, which qwen4_exp programs call)
