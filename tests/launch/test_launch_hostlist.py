"""Slurm hostlist expansion (the expected lists are what ``scontrol show hostnames`` prints)."""

from __future__ import annotations

import re

import pytest

from distaff.launch.hostlist import MAX_HOSTS, HostlistError, expand_hostlist

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


@pytest.mark.parametrize("spec", ["a;touch F,b", "a,$(id)", "n[1-2]`id`", "a b", "-oProxyCommand=x", "a|b",
                                  "n[1-2]&", "x'y", "a\nb", "é.example"])
def test_host_names_a_shell_or_pdsh_would_read_are_refused(spec: str) -> None:
    """The red-team repro: the first host reached deepspeed's remote shell command unquoted as --master_addr."""
    with pytest.raises(ValueError, match="not a host name|control character"):
        expand_hostlist(spec)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec", ["n[0-99999999]", "a[0-9999],b", "r[0-999]n[0-999]", "x[1-10001]",
                                  "n[0-99999999999999999999999999]"])
def test_ranges_beyond_the_host_limit_are_refused_before_expanding(spec: str) -> None:
    with pytest.raises(HostlistError, match=f"names more than {MAX_HOSTS:,} hosts"):
        expand_hostlist(spec)


def test_the_limit_itself_is_accepted() -> None:
    hosts = expand_hostlist(f"n[1-{MAX_HOSTS}]")
    assert len(hosts) == MAX_HOSTS and hosts[-1] == f"n{MAX_HOSTS}"
