"""The positive list of what a saved program may call: the op overloads ``ig.save`` writes, each group with its
reason, and the size arithmetic ``torch.export`` puts between them. Nothing else resolves.

How it was chosen: every overload that ``ig.save`` wrote for the four families (Qwen3.5, its mixture of experts,
Qwen3-Next, Qwen3.8-Flash-Next with its n-gram hashes and sparse attention), sdpa and eager attention, every
standard value, edit slots, fixed edits, SAEs of each architecture, transcoders of each activation, DeltaNet
states and bf16 weights (a survey of their graphs), plus the functional siblings that the supported transformers
releases write for the same modules (a mask by ``masked_fill`` rather than ``where``, ``bmm`` rather than
``matmul``). Each is a pure function of its tensors: no op here opens a file, prints, warns, reads or advances a
random generator, or touches state outside its arguments. No ``.out`` overload, no ``_foreach`` op, no
higher-order op (a subgraph) and no TorchScript builtin is here. Three ops write in place (``INPLACE``); the
sandbox lets them write only tensors the graph made itself. Which results are new storage is a positive list too
(``FRESH``): every other op's result is taken to alias all its tensor arguments, annotated or not (a view, a
cast to the dtype it has, ``_unsafe_view``, a list of views). Two ops take a random generator when told to
(``dropout`` with ``train=True``, ``sdpa`` with a dropout probability); ``CONSTANT`` pins those arguments to
what makes them pure.

The writer refuses to write an op that is not here (``saved.fxdata.target_name``), so what one qgraph writes,
the same qgraph reads; a new op enters by a line here, with its reason.
"""
from __future__ import annotations



from ..export.sizes import SIZE_FUNCTIONS

_GROUPS = {
    "elementwise arithmetic, pure functions of their tensors": """
        add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Tensor rsub.Scalar mul.Tensor mul.Scalar div.Tensor
        div.Scalar div.Tensor_mode neg.default abs.default pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar
        reciprocal.default sqrt.default rsqrt.default exp.default log.default log1p.default expm1.default
        sin.default cos.default tanh.default sigmoid.default erf.default clamp.default clamp_min.default
        clamp_max.default maximum.default minimum.default floor.default ceil.default round.default sign.default
        remainder.Scalar remainder.Tensor floor_divide.default lerp.Scalar""",
    "activations of the models' and SAEs' layers": """
        silu.default gelu.default relu.default softplus.default softmax.int log_softmax.int _softmax.default
        _log_softmax.default""",
    "comparisons, logic and selection by mask": """
        eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor le.Scalar gt.Tensor gt.Scalar
        ge.Tensor ge.Scalar __and__.Tensor __or__.Tensor __xor__.Tensor bitwise_xor.Tensor logical_and.default
        logical_or.default logical_not.default bitwise_and.Tensor bitwise_or.Tensor bitwise_not.default
        where.self where.Scalar where.ScalarOther where.ScalarSelf masked_fill.Scalar masked_fill.Tensor
        isnan.default isinf.default""",
    "reductions and ordering": """
        sum.default sum.dim_IntList mean.default mean.dim amax.default amin.default max.dim min.dim max.default
        min.default argmax.default argmin.default any.default any.dim all.default all.dim topk.default sort.default
        argsort.default cumsum.default cummax.default prod.dim_int var.correction var.dim std.dim
        norm.ScalarOpt_dim linalg_vector_norm.default logsumexp.default""",
    "linear algebra, convolution and attention": """
        linear.default matmul.default mm.default bmm.default addmm.default baddbmm.default
        conv1d.default embedding.default scaled_dot_product_attention.default""",
    "copies of a shape's worth of their input": """
        clone.default repeat.default repeat_interleave.self_int tril.default triu.default""",
    "joining, indexing and scattering into new tensors": """
        cat.default stack.default index.Tensor index_select.default gather.default scatter.src scatter.value
        scatter_add.default index_put.default constant_pad_nd.default pad.default one_hot.default""",
    "a cast into a new tensor (the device checked against this machine at load)": """
        _to_copy.default""",
    "tensors made from sizes and literals (every size bounded at load)": """
        zeros.default ones.default full.default empty.memory_format arange.default arange.start
        arange.start_step zeros_like.default ones_like.default full_like.default empty_like.default
        new_zeros.default new_ones.default new_full.default new_empty.default scalar_tensor.default
        lift_fresh_copy.default""",
}
# Ops whose result may share storage with an argument: views (their schema says so), and ops that return an
# argument itself or a view of it with no annotation to say so. The sandbox takes each result of these to
# alias every tensor argument of its node; a result of any other op on the list is fresh storage (FRESH).
_ALIASING = {
    "shapes and views: a view of their input, or the input itself where no copy is needed": """
        view.default reshape.default _unsafe_view.default flatten.using_ints unflatten.int squeeze.dim
        squeeze.dims squeeze.default unsqueeze.default transpose.int permute.default t.default expand.default
        expand_as.default slice.Tensor select.int narrow.default split.Tensor split_with_sizes.default
        tensor_split.indices chunk.default unbind.int contiguous.default alias.default detach.default
        view_as.default diagonal.default movedim.int""",
    "casts that return their input itself when it already has the dtype and device": """
        to.dtype to.device to.dtype_layout to.other type_as.default""",
    "einsum (a one-operand equation is a permuted view of it)": """
        einsum.default""",
    "dropout in eval mode (train=False: the identity, its input itself, no random numbers)": """
        dropout.default""",
    "checks that export writes (they raise, or do nothing)": """
        _assert_tensor_metadata.default _assert_scalar.default sym_constrain_range_for_size.default
        sym_size.int""",
    "in place, on tensors the graph made itself (the sandbox refuses them on its inputs and held tensors)": """
        copy_.default detach_.default index_put_.default""",
}
_QGRAPH = {
    "qgraph's kernels: the gated delta rule (its state-emitting, writes and attention forms too), the experts, "
    "the edit slots": """
        chunk_gated_delta_rule.default chunk_gated_delta_rule_states.default moe_experts.default
        chunk_gated_delta_rule_writes.default delta_rule_attention.default
        moe_expert_neurons.default moe_experts_down.default edit_slot.default""",
    "qgraph's sparse-attention selection (kernels/qsa.py): each row's blocks of keys gathered by its mask, and a "
    "new bool mask from its scores and mask, their arguments checked by their fakes at load (dtypes, sizes that "
    "agree, an int ratio and budget), allocating by their tensors' sizes alone, whatever the budget": """
        qsa_blocks.default qsa_select.default""",
}
OPS: dict[str, str] = {f"aten.{name}": reason for reason, names in _GROUPS.items() for name in names.split()}
OPS.update({f"qgraph.{name}": reason for reason, names in _QGRAPH.items() for name in names.split()})
# every result of these is new storage: aten's own (tests/test_saved_aliasing.py runs each on the arguments
# most likely to hand back an input: identity pads, powers, casts, one-operand joins), and qgraph's kernels,
# whose results torch.library's custom ops may not alias an input (torch checks it at each call)
FRESH = frozenset(OPS)
OPS.update({f"aten.{name}": reason for reason, names in _ALIASING.items() for name in names.split()})
INPLACE = frozenset(("aten.copy_.default", "aten.detach_.default", "aten.index_put_.default"))
# argument position -> the one value it may hold (otherwise the op reads the global random generator)
CONSTANT: dict[str, dict[int, object]] = {"aten.dropout.default": {2: False},
                                          "aten.scaled_dot_product_attention.default": {4: 0.0}}
# argument position -> the values it may hold, and why no other: the experts op runs the transformers function
# its argument names. "batched_mm" gathers each routed expert's weights for every token (tokens x top-k
# experts' weights at once: memory that the fake run, which sees only the op's output, cannot bound), and
# "deepgemm" and "sonicmoe" fetch their kernels from the Hugging Face Hub.
CHOICES: dict[str, dict[int, tuple]] = {"qgraph.moe_experts.default": {6: ("eager", "grouped_mm")}}

FUNCTIONS = SIZE_FUNCTIONS  # the size arithmetic export writes between ops (``export.sizes``)
