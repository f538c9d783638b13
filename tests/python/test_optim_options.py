"""fusedamp.optim's constructors take torch's arguments, in torch's order and with torch's
defaults, followed by fusedamp's own keyword arguments as their table (optim_options.py) lists
them. Every argument but torch's that the engine has no use for is an option of the C++
engine's table for the class's kind, with the engine's default, and every option of that table
is an argument (or fixed by the class): an option added to the engine and not to Python, or a
default that drifts, fails here. The documentation of each class and of the module is written
from the table of fusedamp's own arguments."""
import inspect
import textwrap

import pytest
import torch

import fusedamp
from fusedamp.optim import FusedOptimizer
from fusedamp.optim_options import (EXTRA_OPTIONS, TORCH_ONLY_ARGUMENTS, engine_arguments,
                                    engine_kinds)

KINDS = {kind.__name__: kind for kind in engine_kinds()}


def _class_of(kind_name):
    """The fusedamp.optim class over the engine's kind (exactly one)."""
    classes = [cls for cls in vars(fusedamp.optim).values()
               if isinstance(cls, type) and issubclass(cls, FusedOptimizer)
               and cls._engine_cls is KINDS[kind_name]]
    assert len(classes) == 1, (kind_name, classes)
    return classes[0]


def _described(parameter):
    return (parameter.name, parameter.kind, parameter.default)


def test_every_kind_is_listed():
    # The engine's kinds are found, not named: the other tests here run over each of them.
    assert {"Adam", "AdamW", "SGD", "Lion"} <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_the_signature_is_the_engines_table(kind):
    cls = _class_of(kind)
    ours = {p.name: p.default for p in inspect.signature(cls).parameters.values()
            if p.name != "params" and p.name not in TORCH_ONLY_ARGUMENTS}
    assert not ours.keys() & cls._fixed_options.keys()
    ours.update(cls._fixed_options)
    # repr: the very values (True is not 1, 0 is not 0.0, torch.float32 is no number).
    assert {n: repr(v) for n, v in ours.items()} == {
        n: repr(v) for n, v in engine_arguments(KINDS[kind]).items()}


def test_the_extra_options_are_the_engines_options_torch_lacks():
    shared = set.intersection(*(set(engine_arguments(kind)) for kind in KINDS.values()))
    torchs = set.intersection(*(set(inspect.signature(getattr(torch.optim, name)).parameters)
                                for name in KINDS if hasattr(torch.optim, name)))
    assert shared - torchs == {option.name for option in EXTRA_OPTIONS}
    for option in EXTRA_OPTIONS:
        defaults = {repr(engine_arguments(kind)[option.name]) for kind in KINDS.values()}
        assert defaults == {repr(option.default)}, option.name


@pytest.mark.parametrize("kind", KINDS)
def test_the_signature_is_torchs_then_the_table(kind):
    name = _class_of(kind).__name__
    ours = list(inspect.signature(getattr(fusedamp.optim, name)).parameters.values())
    if hasattr(torch.optim, name):
        theirs = list(inspect.signature(getattr(torch.optim, name)).parameters.values())
        assert [_described(p) for p in ours[:len(theirs)]] == [_described(p) for p in theirs]
    # Then the algorithm's options torch lacks (test_the_signature_is_the_engines_table holds
    # them to the engine's table), then the table of fusedamp's own; torch's defaults compare
    # equal (0 and 0.0), the table's are the very values.
    tail = ours[len(ours) - len(EXTRA_OPTIONS):]
    assert [(p.name, p.kind, repr(p.default)) for p in tail] == [
        (o.name, inspect.Parameter.KEYWORD_ONLY, repr(o.default)) for o in EXTRA_OPTIONS]


@pytest.mark.parametrize("kind", KINDS)
def test_the_defaults_are_the_signatures(kind):
    cls = _class_of(kind)
    opt = cls([torch.nn.Parameter(torch.zeros(2))])
    expected = {p.name: p.default for p in inspect.signature(cls).parameters.values()
                if p.name != "params"}
    expected.update(cls._fixed_options)  # AdamW: decoupled, recorded as torch's AdamW does
    assert opt.defaults == expected
    assert opt.param_groups[0].items() >= expected.items()


@pytest.mark.parametrize("kind", KINDS)
def test_help_shows_the_extra_arguments(kind):
    cls = _class_of(kind)
    for doc in (inspect.getdoc(cls), fusedamp.optim.__doc__):
        for option in EXTRA_OPTIONS:
            text = textwrap.indent(textwrap.dedent(option.doc), " " * 6)
            assert f"\n  {option.name}={option.default!r}\n{text}" in doc, (cls, option.name)
