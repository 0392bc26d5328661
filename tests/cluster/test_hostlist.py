"""SLURM hostlist expansion (scontrol is absent here, as on most CI machines)."""

import pytest

from megatron_sao.cluster.hostlist import HostlistError, expand_hostlist


@pytest.mark.parametrize("text,expected", [
    ("node01", ["node01"]),
    ("a,b,c", ["a", "b", "c"]),
    ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # padding from the lower bound
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[1-2],cpu[07-08]", ["gpu1", "gpu2", "cpu07", "cpu08"]),
    ("x1,x1,x2", ["x1", "x2"]),  # duplicates collapse, order kept
    ("node-a.cluster[1-2]", ["node-a.cluster1", "node-a.cluster2"]),
])
def test_expand(text, expected):
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("", "empty hostlist"),
    ("n[1-3", "unbalanced '['"),
    ("n1-3]", "unbalanced ']'"),
    ("n[3-1]", "goes backwards"),
    ("n[a-b]", "not numeric"),
    ("n[[1]]", "nested"),
    ("a,,b", "empty entry"),
    ("n[1-100000]", "more than"),
    ("bad host", "invalid host name"),
])
def test_errors_name_the_problem(text, fragment):
    with pytest.raises(HostlistError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(text)
