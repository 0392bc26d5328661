"""The small Python library the generated SWE tasks break: modules of pure functions, each with test cases.

Every task (envs/swe/generated.py) is one module as a repository (``sao_lib/<module>.py`` and a visible
``tests/`` of the cases the bug leaves passing) with one bug injected into one function. The functions
are short and use only the standard library, so a tiny or 135M model's harness can read and fix them on a
CPU, and the hidden tests run with ``python3 -m unittest`` in the sandbox without site-packages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Function:
    name: str
    source: str
    cases: tuple[tuple[tuple, object], ...]  # (arguments, expected result)


@dataclass(frozen=True)
class Module:
    name: str
    functions: tuple[Function, ...]


def _fn(name: str, source: str, *cases: tuple[tuple, object]) -> Function:
    return Function(name, source.lstrip("\n"), tuple(cases))


MODULES: tuple[Module, ...] = (
    Module("numbers", (
        _fn("clamp", """
def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
""",
            ((5, 0, 3), 3), ((-1, 0, 3), 0), ((2, 0, 3), 2), ((3, 0, 3), 3), ((0, 0, 3), 0)),
        _fn("mean", """
def mean(values):
    if not values:
        return 0.0
    return sum(values) / len(values)
""",
            (([1, 2, 3],), 2.0), (([],), 0.0), (([4],), 4.0), (([1, 2],), 1.5)),
        _fn("digit_sum", """
def digit_sum(n):
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
""",
            ((123,), 6), ((0,), 0), ((-45,), 9), ((9,), 9), ((1000,), 1)),
        _fn("is_even", """
def is_even(n):
    return n % 2 == 0
""",
            ((2,), True), ((3,), False), ((0,), True), ((-4,), True)),
        _fn("gcd", """
def gcd(a, b):
    while b != 0:
        a, b = b, a % b
    return abs(a)
""",
            ((12, 8), 4), ((7, 3), 1), ((0, 5), 5), ((-6, 4), 2)),
        _fn("sign", """
def sign(x):
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
""",
            ((5,), 1), ((-2,), -1), ((0,), 0)),
        _fn("percent", """
def percent(part, whole):
    if whole == 0:
        return 0
    return round(100 * part / whole)
""",
            ((1, 4), 25), ((0, 9), 0), ((3, 0), 0), ((2, 3), 67)),
    )),
    Module("text", (
        _fn("count_vowels", """
def count_vowels(s):
    return sum(1 for c in s.lower() if c in 'aeiou')
""",
            (('hello',), 2), (('',), 0), (('AEIOU',), 5), (('xyz',), 0), (('Banana',), 3)),
        _fn("truncate", """
def truncate(s, n):
    if len(s) <= n:
        return s
    return s[:n] + '...'
""",
            (('hello', 10), 'hello'), (('hello', 3), 'hel...'), (('abc', 3), 'abc'), (('', 0), '')),
        _fn("initials", """
def initials(name):
    return ''.join(w[0].upper() for w in name.split())
""",
            (('ada lovelace',), 'AL'), (('Alan',), 'A'), (('',), ''), (('grace b hopper',), 'GBH')),
        _fn("repeat_word", """
def repeat_word(word, times):
    return ' '.join([word] * times)
""",
            (('ab', 3), 'ab ab ab'), (('x', 1), 'x'), (('y', 0), '')),
        _fn("pad_left", """
def pad_left(s, width, fill):
    missing = width - len(s)
    if missing <= 0:
        return s
    return fill * missing + s
""",
            (('7', 3, '0'), '007'), (('abc', 2, ' '), 'abc'), (('ab', 2, '-'), 'ab'), (('', 1, 'x'), 'x')),
        _fn("is_palindrome", """
def is_palindrome(s):
    t = ''.join(c.lower() for c in s if c.isalnum())
    return t == t[::-1]
""",
            (('Racecar',), True), (('ab',), False), (('',), True), (('A man, a plan',), False)),
        _fn("word_count", """
def word_count(s):
    return len(s.split())
""",
            (('a b c',), 3), (('',), 0), (('  one  ',), 1)),
    )),
    Module("sequences", (
        _fn("last_n", """
def last_n(items, n):
    if n <= 0:
        return []
    return items[-n:]
""",
            (([1, 2, 3], 2), [2, 3]), (([1, 2, 3], 0), []), (([1], 5), [1]), (([4, 5, 6], 3), [4, 5, 6])),
        _fn("running_max", """
def running_max(items):
    out = []
    best = None
    for x in items:
        if best is None or x > best:
            best = x
        out.append(best)
    return out
""",
            (([1, 3, 2],), [1, 3, 3]), (([],), []), (([5, 4],), [5, 5]), (([-1, -2, 0],), [-1, -1, 0])),
        _fn("pairs", """
def pairs(items):
    return [(items[i], items[i + 1]) for i in range(len(items) - 1)]
""",
            (([1, 2, 3],), [(1, 2), (2, 3)]), (([1],), []), (([],), []), ((['a', 'b'],), [('a', 'b')])),
        _fn("count_above", """
def count_above(items, limit):
    return sum(1 for x in items if x > limit)
""",
            (([1, 5, 7], 4), 2), (([], 0), 0), (([3, 3], 3), 0), (([4, 9], 3), 2)),
        _fn("chunk", """
def chunk(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
""",
            (([1, 2, 3], 2), [[1, 2], [3]]), (([], 3), []),
            (([1, 2], 2), [[1, 2]]), (([1, 2, 3], 1), [[1], [2], [3]])),
        _fn("index_of", """
def index_of(items, x):
    for i in range(len(items)):
        if items[i] == x:
            return i
    return -1
""",
            (([4, 5, 6], 5), 1), (([4], 9), -1), (([], 1), -1), (([7, 7], 7), 0)),
        _fn("dedupe", """
def dedupe(items):
    seen = set()
    out = []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
""",
            (([1, 1, 2],), [1, 2]), (([],), []), (([3, 2, 3, 1],), [3, 2, 1])),
    )),
)
