"""Function edits that travel as data: a client's ``f(tensor) -> tensor`` exported to an fx graph in a
saved program's format (``saved.fxdata``), rebuilt and checked on the server as a saved program is.

``export_function`` (the client) exports ``fn`` with ``torch.export`` on an example of the value's
layout, its batch and sequence-like axes (``DYNAMIC``) dynamic from 1 to their bound, every other axis
fixed at the value's size. Its graph is export's own (the ops' level saved programs hold); one that calls
an op off their positive list runs ``run_decompositions({})`` first (made functional: an in-place op on a
tensor it made, ``y.add_(v)``, becomes its listed out-of-place form; 4x export's time, so only then). The held
constants (a closure's steering vector, a module's weights) travel as tensors by flat names. The data
is loaded back on the client before it is sent, so what the server would refuse is refused there.

``load_function`` (the server) takes the data as untrusted: every field is checked against a positive
list of keys, types and bounds before anything is made; the graph is rebuilt from the positive list of
ops (``fxdata.graph_from_data``), checked by the sandbox (``saved.sandbox``: purity, aliasing, every
tensor's size bounded), and run on fake tensors to prove its one output has the value's shape. The
callable checks each value against the declared layout and the bounds before the graph runs on it. A
device named in the graph stands for the value's: the graph is rebuilt (and checked) per device it runs on.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from collections.abc import Callable

import torch
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Graph, GraphModule, Node

from .. import compat
from ..errors import EditError, NotSupported, QgraphError, SavedProgramError
from ..saved import sandbox
from ..saved.fields import Fields, dict_of, identifier, integer, list_of, one_of, record, shown, tensor_shape, text
from ..saved.fxdata import graph_data, graph_from_data, held_name

FORMAT = 1
DYNAMIC = {"batch": 2**12, "seq": 2**16, "query": 2**16, "key": 2**16, "patches": 2**16, "image_tokens": 2**16,
           "video_tokens": 2**16}
FLOATS = ("float32", "float16", "bfloat16", "float64")
HELD_DTYPES = (*FLOATS, "int64", "int32", "bool")  # what the wire carries (serve.wire.DTYPES)
LIMITS = {"nodes": 4096, "dims": 8, "size": 2**20, "tensors": 64, "elements": 2**24, "depth": 24}
_FIELDS = {"format", "dims", "graph", "placeholders", "symbols", "tensors"}
_INSTEAD = ("write it with torch ops only (no Python branch or loop on the tensor's values, no .item(), one "
            "tensor of the value's shape returned, working for any batch and length), or use qgraph.Replace, "
            "Add, Scale or Zero")


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, value):
        return self.fn(value)


def export_function(fn, value: torch.Tensor, dims: tuple[str, ...], name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(data, tensors)``: ``fn`` exported over a value laid out as ``dims`` (``value`` gives the fixed
    sizes, the dtype and the device), as JSON-able data and the tensors it holds (CPU copies)."""
    def refuse(reason: str):
        return EditError(f"the function edit {name!r} cannot be sent to the server: {reason}; {_INSTEAD}")

    dims = tuple(dims)
    if not callable(fn):
        raise EditError(f"the edit {name!r} is {type(fn).__name__}: give a function tensor -> tensor or an Edit")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != len(dims) \
            or not all(isinstance(d, str) for d in dims):
        raise EditError(f"the function edit {name!r} needs a floating tensor laid out as {list(dims)} to be exported "
                        f"over, not {type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
    fixed = {size for d, size in zip(dims, value.shape) if d not in DYNAMIC}
    shape, hint = [], iter(n for n in range(2, 2**20) if n not in fixed)
    for d, size in zip(dims, value.shape):  # distinct sizes past 1 (0 and 1 are specialised), none a fixed one's
        shape.append(next(hint) if d in DYNAMIC else int(size))
    example = torch.zeros(shape, dtype=value.dtype, device=value.device)
    with torch.no_grad():
        try:
            out = fn(example)
        except Exception as error:  # noqa: BLE001 (the user's function failing is the reason)
            raise refuse(f"it raised {type(error).__name__} on a {tuple(shape)} example "
                         f"({_first_line(error)})") from error
    if not isinstance(out, torch.Tensor) or out.shape != example.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise refuse(f"it returned {got} for a value of shape {tuple(shape)}; it must return a tensor of its shape")
    axes = {i: Dim(d, min=1, max=DYNAMIC[d]) for i, d in enumerate(dims) if d in DYNAMIC}
    try:
        with compat.tracing(), _quiet():  # one export at a time (client threads); _quiet's redirect is global too
            exported = compat.export(_Call(fn), {"value": example}, {"value": axes})
            try:
                graph, tensors = _as_data(exported)
            except NotSupported:  # an in-place op (add_) on a tensor it made: its functional form may be listed
                graph, tensors = _as_data(exported.run_decompositions({}))
    except NotSupported as error:
        raise refuse(str(error)) from None
    except Exception as error:  # noqa: BLE001 (torch's reason, its first line, is what the user needs)
        fixes = " (its code fixes that size to the example's: it must work for any)" \
            if _first_line(error).startswith("Constraints violated") else ""
        raise refuse(f"torch.export cannot export it ({_first_line(error)}){fixes}") from None
    held = {key: tensor.detach().to("cpu").contiguous().clone() for key, tensor in tensors.items()}
    symbols = {d: {"min": 1, "max": DYNAMIC[d]} for d in dims if d in DYNAMIC}
    data = {"format": FORMAT, "dims": list(dims), "graph": graph, "symbols": symbols,
            "placeholders": [{"shape": [d if d in DYNAMIC else int(s) for d, s in zip(dims, value.shape)],
                              "dtype": str(value.dtype).removeprefix("torch."), "device": str(value.device)}],
            "tensors": {key: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                        for key, t in held.items()}}
    try:
        loaded = load_function(data, held, name)  # what the server would refuse, refused here
    except QgraphError as error:
        raise refuse(str(error)) from None
    least = [1 if d in DYNAMIC else int(s) for d, s in zip(dims, value.shape)]
    try:  # the smallest slice the server may run it on (an index past it fails only when run)
        with torch.no_grad():
            loaded(torch.zeros(least, dtype=value.dtype))
    except Exception as error:  # noqa: BLE001 (any failure at the smallest sizes is the reason)
        raise refuse(f"it fails on a value of shape {tuple(least)}, the smallest the server may run it on "
                     f"({_first_line(error)})") from None
    return data, held


@contextlib.contextmanager
def _quiet():
    """No warnings, logs or prints of torch's while it exports (a data-dependent branch prints the graph
    to stderr): a refusal says what failed."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _as_data(exported) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    return graph_data(_module(exported), tensors), tensors


def _module(exported) -> GraphModule:
    """The exported graph as one placeholder (the value), ``get_attr`` of its held tensors and one output."""
    signature, graph = exported.graph_signature, Graph()
    env: dict[Node, Node] = {}  # the export's node -> its copy in graph
    held: dict[str, torch.Tensor] = {}  # the name of a tensor graph reads -> it
    kinds = [spec.kind for spec in signature.output_specs]
    if kinds != [OutputKind.USER_OUTPUT]:
        written = ", ".join(sorted({k.name.lower() for k in kinds if k != OutputKind.USER_OUTPUT}))
        raise NotSupported(f"it writes a tensor in place ({written}) or returns more than one tensor: return a new "
                           f"tensor (x * 2, not x.mul_(2))")
    for spec, node in zip(signature.input_specs, exported.graph.find_nodes(op="placeholder")):
        if spec.kind == InputKind.USER_INPUT:
            env[node] = graph.placeholder("value")
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensor = exported.state_dict[spec.target] if spec.target in exported.state_dict \
                else exported.constants[spec.target]
            held[f"held{len(held)}"] = tensor
            env[node] = graph.get_attr(f"held{len(held) - 1}")
        else:
            raise NotSupported(f"it reads a {spec.kind.name.lower()} ({spec.target}), which a function edit cannot "
                               f"hold")
    for node in exported.graph.nodes:
        if node.op == "output":
            graph.output(env[node.args[0][0]])
        elif node.op != "placeholder":
            if node.op != "call_function":
                raise NotSupported(f"its graph holds a {node.op} ({node.target}): a function edit holds op calls only")
            env[node] = graph.node_copy(node, env.__getitem__)
    return GraphModule(held, graph)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


# -- the server -------------------------------------------------------------------------------------


def load_function(data: dict, tensors: dict[str, torch.Tensor], name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function edit ``export_function`` made, from untrusted ``data`` and ``tensors``: checked, rebuilt
    and sandboxed (a ``SavedProgramError`` naming what is wrong otherwise); its call checks the value."""
    where = f"the function edit {str(name)[:100]!r}"
    _check_fields(data, tensors, where)
    loaded = _Loaded(data, tensors, where)
    loaded.on(torch.device("cpu"))  # every check at load, whatever device it runs on later
    return loaded


def _check_fields(data, tensors, where: str) -> None:
    fields = Fields(data, where, keys=_FIELDS, exact=True)
    fields.get("format", integer(FORMAT, FORMAT), f"{FORMAT}")
    dims = fields.get("dims", list_of(identifier(64), 1, LIMITS["dims"], distinct=True),
                      f"1 to {LIMITS['dims']} distinct names")
    dynamic = [d for d in dims if d in DYNAMIC]
    fields.get("symbols", lambda symbols: isinstance(symbols, dict) and set(symbols) == set(dynamic) and all(
        record({"min": integer(1, DYNAMIC[d]), "max": integer(1, DYNAMIC[d])})(s) and s["min"] <= s["max"]
        for d, s in symbols.items()),
        f"{{dim: {{min, max}}}} for exactly its dims {dynamic}, within their bounds {DYNAMIC}")
    [spec] = fields.get("placeholders", list_of(record({"shape": lambda v: isinstance(v, list), "dtype": one_of(FLOATS),
                                                        "device": text(64)}), 1, 1),
                       f"exactly one input {{shape, dtype (one of {', '.join(FLOATS)}), device}}")
    shape = spec["shape"]
    if not (len(shape) == len(dims) and all(size == d if d in DYNAMIC else integer(1, LIMITS["size"])(size)
                                            for d, size in zip(dims, shape))):
        fields.fail("placeholders", f"gives its input a shape not its dims' (a batch or sequence axis by its name, "
                                    f"any other a size of 1 to {LIMITS['size']:,}): {shown(shape)}")
    if math.prod(size for size in shape if isinstance(size, int)) > LIMITS["elements"]:
        fields.fail("placeholders", f"gives its input fixed sizes of more than {LIMITS['elements']:,} elements")
    declared = fields.get("tensors", dict_of(record({"shape": tensor_shape(LIMITS["dims"], LIMITS["elements"]),
                                                    "dtype": one_of(HELD_DTYPES)}), held_name, LIMITS["tensors"]),
                          f"at most {LIMITS['tensors']} {{flat name: {{shape, dtype}}}}")
    if sum(math.prod(t["shape"]) for t in declared.values()) > LIMITS["elements"]:
        fields.fail("tensors", f"holds more than {LIMITS['elements']:,} elements")
    if not isinstance(tensors, dict) or set(tensors) != set(declared):
        fields.refuse(f"it is given other tensors than its data names ({', '.join(sorted(declared)[:5])})")
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != declared[key]["shape"] \
                or str(tensor.dtype).removeprefix("torch.") != declared[key]["dtype"]:
            fields.refuse(f"its tensor {key} is not the {declared[key]['dtype']} {declared[key]['shape']} its data "
                          f"says")
    nodes = fields.get("graph", record({"nodes": lambda v: isinstance(v, list)}), "{nodes: [...]}")["nodes"]
    if len(nodes) > LIMITS["nodes"]:
        fields.fail("graph", f"has {len(nodes):,} nodes, more than a function edit may have ({LIMITS['nodes']:,})")


def _on_device(value, device: str, depth: int = 0):
    """The graph's JSON ``value`` with every device it names (``{"device": str}``) made ``device``, the value's."""
    if depth > LIMITS["depth"]:  # past any nesting fxdata reads (lists and tags, 8 deep)
        raise SavedProgramError("its graph holds arguments nested too deep")
    if isinstance(value, list):
        return [_on_device(item, device, depth + 1) for item in value]
    if isinstance(value, dict):
        if set(value) == {"device"} and isinstance(value["device"], str):
            return {"device": device}
        return {key: _on_device(item, device, depth + 1) for key, item in value.items()}
    return value


class _Loaded:
    """A loaded function edit: its graph and bounds per device, built from the checked data on first use."""

    def __init__(self, data: dict, tensors: dict, where: str):
        self.data, self.tensors, self.where = data, tensors, where
        self._built: dict[torch.device, tuple[GraphModule, sandbox.Bounds]] = {}  # device -> its graph, bounds
        self.dims = tuple(data["dims"])
        self.shape = data["placeholders"][0]["shape"]
        self.dtype = getattr(torch, data["placeholders"][0]["dtype"])

    def on(self, device: torch.device):
        with compat.tracing():  # its checks' fake runs: one trace at a time in the process (compat.tracing)
            return self._on(device)

    def _on(self, device: torch.device):
        if device not in self._built:
            try:
                nodes = _on_device(self.data["graph"]["nodes"], str(device))
            except SavedProgramError as error:
                raise SavedProgramError(f"{self.where}: {error}") from None
            held = {key: tensor.to(device) for key, tensor in self.tensors.items()}
            module = graph_from_data({"nodes": nodes}, held, self.where)
            if len(module.graph.find_nodes(op="placeholder")) != 1:
                raise SavedProgramError(f"{self.where}: its graph has {len(module.graph.find_nodes(op='placeholder'))} "
                                        f"inputs; a function edit takes one, the value")
            placeholders = [{**self.data["placeholders"][0], "device": str(device)}]
            bounds = sandbox.check(module, placeholders, self.data["symbols"], [False], self.where)
            self._check_output(module, placeholders[0], device)
            self._built[device] = module, bounds
        return self._built[device]

    def _check_output(self, module: GraphModule, spec: dict, device: torch.device) -> None:
        """Run the graph on a fake value (its batch and sequence axes symbols): one tensor of its shape."""
        mode = compat.fake_mode()
        hints = [63 + 2 * i if isinstance(size, str) else size for i, size in enumerate(spec["shape"])]
        value = compat.fake(mode, torch.empty(hints, dtype=self.dtype, device=device),
                            dynamic=[isinstance(size, str) for size in spec["shape"]])

        class Fake(torch.fx.Interpreter):
            def get_attr(self, target, args, kwargs):
                return compat.fake(mode, super().get_attr(target, args, kwargs), dynamic=False)

        with mode:
            out = Fake(module).run(value)
        same = isinstance(out, torch.Tensor) and out.dim() == value.dim() and all(
            compat.size_expression(a) == compat.size_expression(b) for a, b in zip(out.shape, value.shape))
        if not same or not out.is_floating_point():
            got = f"a {out.dtype} tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) \
                else type(out).__name__
            raise SavedProgramError(f"{self.where}: its graph returns {got}; a function edit returns a floating "
                                    f"tensor of its input's shape {list(value.shape)}")

    def work(self, shape: list) -> float:
        """The floating-point operations of one call on a value of ``shape`` (``saved.work``)."""
        return self.on(torch.device("cpu"))[1].work_at([shape])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layout = f"[{' '.join(self.dims)}]"
        if not isinstance(x, torch.Tensor) or x.dim() != len(self.dims) or x.dtype != self.dtype or any(
                size != want if isinstance(want, int) else size < 1 for size, want in zip(x.shape, self.shape)):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise EditError(f"{self.where} was exported for {str(self.dtype).removeprefix('torch.')} values "
                            f"{layout} of shape {self.shape}; this value is {got}")
        module, bounds = self.on(x.device)
        bounds.check([x])
        out = module(x.contiguous())  # a request's rows cropped to its length: a view its graph may not view
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise EditError(f"{self.where} returned {getattr(out, 'shape', type(out).__name__)} for a value of "
                            f"shape {tuple(x.shape)}")
        return out.to(x.dtype)

    def __repr__(self) -> str:
        return f"<function edit {self.where[len('the function edit '):]} over [{' '.join(self.dims)}]>"
