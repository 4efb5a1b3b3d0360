"""The checks of untrusted fields (``qgraph.saved.fields``), on any JSON a sender may write: a bool is never
an int, NaN and the infinities never a number, a text past its bound never a text, every predicate false
(never raising) on a value of another type, and ``Fields`` refusing with the caller's error class, naming the
field. Examples are derandomized and few: the file runs in about a second."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.errors import SavedProgramError
from qgraph.saved.fields import (Fields, dict_of, dtype_name, either, flag, identifier, integer, list_of, number,
                                 one_of, optional, record, shown, tensor_shape, text)
from qgraph.saved.schema import FACT_CHECKS, check_graph_fields
from qgraph.serve.request import Unprocessable
from qgraph.serve.wire import WireError
from qgraph.values.catalogue import FACTS

FAST = settings(max_examples=60, derandomize=True, deadline=None)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=6)
# each predicate and the one Python type (or None) its values have
PREDICATES = [
    (flag, bool), (integer(), int), (integer(0, 10), int), (number(), (int, float)), (number(1e6), (int, float)),
    (text(), str), (text(8, printable=True), str), (identifier(), str), (one_of({"a", "1"}), str),
    (dtype_name, str), (list_of(integer()), list), (list_of(text(), 1, 2, distinct=True), list),
    (dict_of(integer()), dict), (record({"a": integer()}), dict), (tensor_shape(8, 2**40), list),
]


@FAST
@given(JSON)
def test_every_predicate_is_false_on_another_type_and_never_raises(value):
    for check, kind in PREDICATES:
        taken = check(value)
        assert taken in (True, False)
        if taken:
            assert isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), (check, value)


@FAST
@given(st.booleans(), st.integers(-5, 5), st.integers(0, 5))
def test_a_bool_is_never_an_int_nor_a_number(value, low, span):
    assert not integer()(value) and not integer(low, low + span)(value) and not number()(value)
    assert not list_of(integer())([value]) and not tensor_shape(8, 10)([value]) and flag(value)


@FAST
@given(st.integers(), st.integers(-100, 100), st.integers(0, 100))
def test_an_int_is_taken_inside_its_bounds_only(value, low, span):
    assert integer()(value)
    assert integer(low, low + span)(value) == (low <= value <= low + span)


@FAST
@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(1, 1e9))
def test_nan_and_the_infinities_are_never_numbers(value, bound):
    finite = math.isfinite(value)
    assert number()(value) == finite
    assert number(bound)(value) == (finite and abs(value) < bound)


def test_a_huge_int_is_compared_not_converted():
    assert number()(10**400) and not number(1e6)(10**400)  # float(10**400) would raise OverflowError
    assert not integer(0, 2**62 - 1)(2**62) and integer(0, 2**62 - 1)(2**62 - 1)


@FAST
@given(st.text(max_size=40), st.integers(1, 30))
def test_a_text_is_taken_within_its_length_and_characters(value, high):
    assert text(high)(value) == (0 < len(value) <= high)
    assert text(high, printable=True)(value) == (0 < len(value) <= high and value.isprintable())
    assert not text(high)(value * (high + 1) if value else "") and not text()("x" * 4097)


def test_names_and_dtypes():
    assert not one_of({"w": 1})(["w"]) and not one_of({"1": 1})(1) and not one_of({"1"})(True)  # nothing hashed
    assert one_of({"w": 1})("w")
    assert dtype_name("float32") and dtype_name("torch.bfloat16") and dtype_name("half")
    assert not any(map(dtype_name, ["__class__", "Tensor", "nn", "float33", "", "torch.", 7]))
    assert identifier(4)("dims") and not identifier(3)("dims") and not identifier()("hidden size")
    assert list_of(text(), distinct=True)(["a", "b"]) and not list_of(text(), distinct=True)(["a", "a"])
    one_or_two = list_of(integer(), 1, 2)
    assert one_or_two([1, 2]) and not one_or_two([]) and not one_or_two([1] * 3)
    assert either(integer(0, 1), one_of({"seq"}))("seq") and optional(integer())(None) and not optional(integer())("")
    only_a = record({"a": flag})
    assert only_a({"a": True}) and not only_a({"a": True, "b": 1}) and not only_a({}) and not only_a({"a": 1})
    assert dict_of(flag, high=1)({"a": True}) and not dict_of(flag, high=1)({"a": True, "b": False})
    assert not dict_of(flag)({"": True})  # a key is a text of 1 character or more


def test_a_shown_value_is_short_and_escaped():
    assert shown("a\nb\x1b[31m") == repr("a\nb\x1b[31m")
    assert len(shown(["x" * 10_000] * 10_000)) <= 100 and len(shown({str(i): [[[i]]] for i in range(99)})) <= 100


def test_fields_refuse_with_the_callers_class_naming_the_field():
    fields = Fields({"n": True, "s": "x"}, "the call", Unprocessable, keys={"n", "s", "m"})
    with pytest.raises(Unprocessable, match=r"^the call: its field 'n' is not a count: True$"):
        fields.get("n", integer(), "a count")
    with pytest.raises(Unprocessable, match=r"the call: its field 'm' is missing \(it holds a count\)"):
        fields.get("m", integer(), "a count")
    assert fields.get("m", integer(), "a count", default=3) == 3 and fields.get("s", text(), "a text") == "x"
    with pytest.raises(WireError, match=r"the call is not an object of fields among m, n, s: it holds \['x'\] too"):
        Fields({"x": 1}, "the call", Unprocessable, keys={"n", "s", "m"}, unknown=WireError)
    with pytest.raises(SavedProgramError, match=r"the edit is not an object of exactly the fields a, b: it lacks \['b"):
        Fields({"a": 1}, "the edit", keys={"a", "b"}, exact=True)
    with pytest.raises(SavedProgramError, match=r"the edit is not an object of exactly the fields a: \[1\]"):
        Fields([1], "the edit", keys={"a"}, exact=True)
    with pytest.raises(WireError, match="^x: odd$"):
        Fields({}, "x", WireError).refuse("odd")


def test_a_graph_input_naming_a_parameter_by_a_list_is_refused_not_raised():
    """``{"parameter": [...]}`` in graph.json: once a TypeError (a list looked up in a dict), now refused."""
    meta = {"inputs": [], "parameters": {"w": [[4], "float32"]}}
    data = {"graph": {}, "inputs": [{"parameter": ["w"]}], "tensors": {}, "placeholders": [], "symbols": {}}
    with pytest.raises(SavedProgramError, match=r"x \(graph.json\): its field 'inputs' is not what feeds each input"):
        check_graph_fields(data, meta, "x")
    data["inputs"] = [{"parameter": "w"}]
    data["placeholders"] = [{"shape": [4], "dtype": "float32", "device": "cpu"}]
    check_graph_fields(data, meta, "x")
    data["placeholders"][0]["shape"] = [True]
    with pytest.raises(SavedProgramError, match="field 'placeholders'"):
        check_graph_fields(data, meta, "x")


def test_every_fact_of_a_saved_catalogue_has_its_check():
    assert set(FACT_CHECKS) == set(FACTS)
