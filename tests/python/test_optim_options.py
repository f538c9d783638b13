"""fusedamp.optim's constructors take torch's arguments, in torch's order and with torch's
defaults, followed by fusedamp's own keyword arguments as their table (optim_options.py) lists
them; the documentation of each class and of the module is written from that table."""
import inspect
import textwrap

import pytest
import torch

import fusedamp
from fusedamp.optim_options import EXTRA_OPTIONS

CLASSES = ["Adam", "AdamW", "SGD", "Lion"]


def _described(parameter):
    return (parameter.name, parameter.kind, parameter.default)


@pytest.mark.parametrize("name", CLASSES)
def test_the_signature_is_torchs_then_the_table(name):
    ours = list(inspect.signature(getattr(fusedamp.optim, name)).parameters.values())
    if hasattr(torch.optim, name):
        theirs = list(inspect.signature(getattr(torch.optim, name)).parameters.values())
        assert [_described(p) for p in ours[:len(theirs)]] == [_described(p) for p in theirs]
        head = len(theirs)
    else:  # torch has no such optimizer (Lion): its own arguments, then the table
        head = [p.name for p in ours].index(EXTRA_OPTIONS[0].name)
    # torch's defaults compare equal (0 and 0.0); the table's are the very values.
    assert [(p.name, p.kind, repr(p.default)) for p in ours[head:]] == [
        (o.name, inspect.Parameter.KEYWORD_ONLY, repr(o.default)) for o in EXTRA_OPTIONS]


@pytest.mark.parametrize("name", CLASSES)
def test_the_defaults_are_the_signatures(name):
    cls = getattr(fusedamp.optim, name)
    opt = cls([torch.nn.Parameter(torch.zeros(2))])
    expected = {p.name: p.default for p in inspect.signature(cls).parameters.values()
                if p.name != "params"}
    if name == "AdamW":  # decoupled by construction, recorded as torch's AdamW records it
        expected["decoupled_weight_decay"] = True
    assert opt.defaults == expected
    assert opt.param_groups[0].items() >= expected.items()


@pytest.mark.parametrize("name", CLASSES)
def test_help_shows_the_extra_arguments(name):
    cls = getattr(fusedamp.optim, name)
    for doc in (inspect.getdoc(cls), fusedamp.optim.__doc__):
        for option in EXTRA_OPTIONS:
            text = textwrap.indent(textwrap.dedent(option.doc), " " * 6)
            assert f"\n  {option.name}={option.default!r}\n{text}" in doc, (name, option.name)
