"""Slurm hostlist expansion (the expected lists are what ``scontrol show hostnames`` prints)."""

from __future__ import annotations

import re

import pytest

from distaff.launch.hostlist import HostlistError, expand_hostlist

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec, hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("node[009-011],login", ["node009", "node010", "node011", "login"]),
    ("x[8-11]", ["x8", "x9", "x10", "x11"]),            # no padding: widths grow
    ("a[9-10]", ["a9", "a10"]),
    ("r[1-2]n[08-10]", ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]),  # leftmost slowest
    ("h[1,1]", ["h1", "h1"]),                           # duplicates kept, as Slurm does
    ("single", ["single"]),
    (" n1 , n2 ", ["n1", "n2"]),
    ("rack-[1-2].ib", ["rack-1.ib", "rack-2.ib"]),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec, problem", [
    ("gpu[01-03", "'[' without ']'"),
    ("gpu01]", "']' without '['"),
    ("gpu[[1]]", "nested"),
    ("gpu[3-1]", "runs backwards"),
    ("gpu[a-b]", "bad range 'a-b'"),
    ("gpu[]", "bad range ''"),
    ("a,,b", "empty host name"),
    ("", "empty host name"),
])
def test_bad_hostlist_names_the_problem(spec: str, problem: str) -> None:
    with pytest.raises(HostlistError, match=re.escape(problem)) as info:
        expand_hostlist(spec)
    assert repr(spec) in str(info.value)
