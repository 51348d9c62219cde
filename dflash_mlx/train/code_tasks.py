"""Small written programming tasks with reference solutions (round 6's ``round6-code``).

Each `Task` is a problem on lists, strings or numbers in HumanEval's manner: a name, its
arguments, a one-paragraph docstring, and a reference solution that computes the
docstring's examples from random inputs (`code_prompts`), so the examples are right. A
task's parameter (a divisor, a length, an order) makes variants of it: the same function
asked for with another constant.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any, Callable, NamedTuple


class Task(NamedTuple):
    """A written task: `doc` (with ``{k}`` and ``{nth}``: its parameter and its ordinal)
    for each value of `params`, `solve(k)` the reference solution, `inputs(rng)` one
    call's arguments."""

    name: str
    args: str
    doc: str
    params: tuple
    solve: Callable[[Any], Callable]
    inputs: Callable[[random.Random], tuple]


_WORDS = (
    "apple river stone cloud garden window tiger music pencil orange bridge candle forest planet silver "
    "rocket yellow dragon island ladder moon sea sky tea art code data kite wolf zebra echo level noon"
).split()


def _ints(rng: random.Random) -> tuple:
    return ([rng.randint(0, 40) for _ in range(rng.randint(4, 8))],)


def _signed(rng: random.Random) -> tuple:
    return ([rng.randint(-20, 20) for _ in range(rng.randint(4, 8))],)


def _int(rng: random.Random) -> tuple:
    return (rng.randint(1, 60),)


def _big(rng: random.Random) -> tuple:
    return (rng.randint(10, 99999),)


def _word_list(rng: random.Random) -> tuple:
    return (rng.sample(_WORDS, rng.randint(3, 6)),)


def _sentence(rng: random.Random) -> tuple:
    return (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 7))),)


def _two_lists(rng: random.Random) -> tuple:
    return _ints(rng) + _ints(rng)


def _matrix(rng: random.Random) -> tuple:
    n, m = rng.randint(2, 3), rng.randint(2, 4)
    return ([[rng.randint(0, 9) for _ in range(m)] for _ in range(n)],)


def _primes_below(n: int) -> list[int]:
    return [p for p in range(2, n) if all(p % d for d in range(2, math.isqrt(p) + 1))]


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _to_base(k: int) -> Callable[[int], str]:
    def convert(n: int) -> str:
        digits = ""
        while n:
            n, digits = n // k, str(n % k) + digits
        return digits or "0"

    return convert


def _balanced(text: str) -> bool:
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def _brackets(rng: random.Random) -> tuple:
    return ("".join(rng.choice("()[]{}ab") for _ in range(rng.randint(2, 8))),)


def _run_length(text: str) -> str:
    out, i = "", 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out, i = out + f"{text[i]}{j - i}", j
    return out


def _runs(rng: random.Random) -> tuple:
    return ("".join(rng.choice("abc") * rng.randint(1, 4) for _ in range(rng.randint(2, 4))),)


def _alternate(k: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        out, upper = [], k == "upper"
        for ch in text:
            out.append(ch.upper() if upper else ch.lower())
            upper ^= ch.isalpha()
        return "".join(out)

    return convert


def _triangle(a: int, b: int, c: int) -> str:
    x, y, z = sorted((a, b, c))
    if x + y <= z:
        return "invalid"
    return "equilateral" if x == z else "isosceles" if x == y or y == z else "scalene"


TASKS = (
    Task("count_divisible", "numbers", "Return how many numbers in the list are divisible by {k}.", (2, 3, 4, 5, 7),
         lambda k: lambda xs: sum(x % k == 0 for x in xs), _ints),
    Task("longer_words", "words", "Return the words that have more than {k} letters, in their original order.",
         (3, 4, 5), lambda k: lambda ws: [w for w in ws if len(w) > k], _word_list),
    Task("nth_largest", "numbers", "Return the {nth} largest distinct value in the list, or None if there are "
         "fewer than {k} distinct values.", (2, 3),
         lambda k: lambda xs: sorted(set(xs))[-k] if len(set(xs)) >= k else None, _ints),
    Task("nth_smallest", "numbers", "Return the {nth} smallest distinct value in the list, or None if there are "
         "fewer than {k} distinct values.", (2, 3),
         lambda k: lambda xs: sorted(set(xs))[k - 1] if len(set(xs)) >= k else None, _ints),
    Task("rotate_right", "items", "Return a new list: the items rotated {k} places to the right.", (1, 2, 3),
         lambda k: lambda xs: xs[-(k % len(xs)):] + xs[: -(k % len(xs))] if k % len(xs) else list(xs), _ints),
    Task("shift_letters", "text", "Shift every lowercase letter {k} places forward in the alphabet, wrapping "
         "from 'z' to 'a'. Other characters stay as they are.", (1, 3, 13),
         lambda k: lambda s: "".join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s), _sentence),
    Task("chunks", "items", "Split the list into consecutive chunks of {k} items; the last chunk may be shorter.",
         (2, 3), lambda k: lambda xs: [xs[i : i + k] for i in range(0, len(xs), k)], _ints),
    Task("pairs_with_sum", "numbers", "Return the sorted list of pairs (a, b) of values in the list with a < b "
         "and a + b == {k}, without repeats.", (10, 20, 30),
         lambda k: lambda xs: sorted({(a, k - a) for a in xs if a < k - a and k - a in xs}), _ints),
    Task("running", "numbers", "Return a list whose i-th element is the {k} of numbers[0] to numbers[i].",
         ("sum", "maximum", "minimum"),
         lambda k: lambda xs: [({"sum": sum, "maximum": max, "minimum": min}[k])(xs[: i + 1]) for i in range(len(xs))],
         _signed),
    Task("is_power_of", "n", "Return True if n is a power of {k} ({k} ** 0 == 1 counts), else False.", (2, 3, 5),
         lambda k: lambda n: n >= 1 and k ** round(math.log(n, k)) == n, _int),
    Task("to_base", "n", "Return the digits of the non-negative integer n written in base {k}, as a string.",
         (2, 3, 5, 8), _to_base, _int),
    Task("gcd_of_list", "numbers", "Return the greatest common divisor of all the numbers in the list.", (None,),
         lambda k: lambda xs: math.gcd(*xs), lambda rng: ([rng.randint(1, 9) * 6 for _ in range(4)],)),
    Task("primes_below", "n", "Return the list of prime numbers smaller than n.", (None,),
         lambda k: _primes_below, _int),
    Task("collatz_steps", "n", "Count the steps the Collatz process takes to reach 1 from n: an even number is "
         "halved, an odd one becomes 3 * n + 1.", (None,), lambda k: _collatz, _int),
    Task("fizz_buzz_list", "n", "Return a list of strings for 1 to n: 'Fizz' for multiples of {k}, 'Buzz' for "
         "multiples of 5, 'FizzBuzz' for both, otherwise the number itself.", (3, 4, 7),
         lambda k: lambda n: ["Fizz" * (i % k == 0) + "Buzz" * (i % 5 == 0) or str(i) for i in range(1, n + 1)],
         lambda rng: (rng.randint(5, 16),)),
    Task("sort_by_length", "words", "Sort the words by length, {k}; words of equal length keep their order.",
         ("shortest first", "longest first"),
         lambda k: lambda ws: sorted(ws, key=len, reverse=k == "longest first"), _word_list),
    Task("middle_value", "numbers", "Return the middle element of the list; for an even length, the mean of the "
         "two middle elements.", (None,),
         lambda k: lambda xs: xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2,
         _ints),
    Task("pairs_apart", "numbers", "Count the pairs of positions i < j where the values differ by exactly {k}.",
         (1, 2, 5), lambda k: lambda xs: sum(abs(a - b) == k for i, a in enumerate(xs) for b in xs[i + 1 :]), _ints),
    Task("reverse_each_word", "sentence", "Reverse the letters of each word and keep the words in their order.",
         (None,), lambda k: lambda s: " ".join(w[::-1] for w in s.split()), _sentence),
    Task("reverse_word_order", "sentence", "Return the sentence with its words in reverse order.", (None,),
         lambda k: lambda s: " ".join(s.split()[::-1]), _sentence),
    Task("digital_root", "n", "Add the digits of n, then the digits of the result, until one digit is left; "
         "return it.", (None,), lambda k: lambda n: 1 + (n - 1) % 9 if n else 0, _big),
    Task("best_window", "numbers", "Return the largest sum of {k} consecutive numbers in the list.", (2, 3),
         lambda k: lambda xs: max(sum(xs[i : i + k]) for i in range(len(xs) - k + 1)), _signed),
    Task("count_starting_with", "sentence", "Count the words that start with the letter '{k}'.", ("s", "r", "a"),
         lambda k: lambda s: sum(w.startswith(k) for w in s.split()), _sentence),
    Task("sum_at_indices", "numbers", "Return the sum of the elements at {k} indices (the first index is 0).",
         ("even", "odd"), lambda k: lambda xs: sum(xs[k == "odd" :: 2]), _signed),
    Task("clamp_all", "numbers", "Replace every number above {k} with {k} and every negative number with 0.",
         (5, 10), lambda k: lambda xs: [min(max(x, 0), k) for x in xs], _signed),
    Task("is_sorted", "numbers", "Return True if the list is in {k} order.", ("non-decreasing", "strictly increasing"),
         lambda k: lambda xs: all(a < b if k[0] == "s" else a <= b for a, b in zip(xs, xs[1:])),
         lambda rng: (sorted(_ints(rng)[0]) if rng.random() < 0.6 else _ints(rng)[0],)),
    Task("acronym", "phrase", "Return the acronym of the phrase: the first letter of each word, in uppercase.",
         (None,), lambda k: lambda s: "".join(w[0].upper() for w in s.split()), _sentence),
    Task("trimmed_mean", "numbers", "Return the mean of the list without its {k} smallest and {k} largest values.",
         (1, 2), lambda k: lambda xs: sum(sorted(xs)[k:-k]) / (len(xs) - 2 * k),
         lambda rng: ([rng.randint(0, 40) for _ in range(rng.randint(5, 9))],)),
    Task("count_overlapping", "text, part", "Count how many times part occurs in text, overlapping occurrences "
         "included.", (None,), lambda k: lambda s, p: sum(s.startswith(p, i) for i in range(len(s))),
         lambda rng: ("".join(rng.choice("ab") for _ in range(rng.randint(5, 10))), rng.choice(("a", "ab", "aa")))),
    Task("transpose", "matrix", "Return the transpose of the matrix (a list of rows).", (None,),
         lambda k: lambda m: [list(r) for r in zip(*m)], _matrix),
    Task("column_sums", "matrix", "Return the list of the sums of each column of the matrix.", (None,),
         lambda k: lambda m: [sum(c) for c in zip(*m)], _matrix),
    Task("common_values", "first, second", "Return the sorted values that occur in both lists, each once.",
         (None,), lambda k: lambda a, b: sorted(set(a) & set(b)), _two_lists),
    Task("interleave", "first, second", "Take items from the two lists in turn, starting with the first; "
         "the rest of the longer list goes at the end.", (None,),
         lambda k: lambda a, b: [x for p in zip(a, b) for x in p] + a[len(b) :] + b[len(a) :], _two_lists),
    Task("word_counts", "sentence", "Return a dict mapping each word to how many times it occurs.", (None,),
         lambda k: lambda s: dict(Counter(s.split())), _sentence),
    Task("most_common_letter", "sentence", "Return the letter that occurs most often (spaces do not count); "
         "on a tie, the one that comes first in the alphabet.", (None,),
         lambda k: lambda s: min(set(s) - {" "}, key=lambda c: (-s.count(c), c)), _sentence),
    Task("balanced_brackets", "text", "Return True if the brackets (), [] and {{}} in the text are balanced and "
         "properly nested; other characters are ignored.", (None,), lambda k: _balanced, _brackets),
    Task("run_length", "text", "Encode the text by run-length: each run of one character becomes the character "
         "followed by the length of the run.", (None,), lambda k: _run_length, _runs),
    Task("sum_of_squares", "numbers", "Return the sum of the squares of the {k} numbers in the list.",
         ("odd", "even", "negative"),
         lambda k: lambda xs: sum(x * x for x in xs if {"odd": x % 2, "even": x % 2 == 0, "negative": x < 0}[k]),
         _signed),
    Task("rises", "numbers", "Count the elements that are greater than the element just before them.", (None,),
         lambda k: lambda xs: sum(b > a for a, b in zip(xs, xs[1:])), _ints),
    Task("digit_product", "n", "Return the product of the {k} digits of n, or 0 if it has none.", ("odd", "even"),
         lambda k: lambda n: math.prod(d for d in map(int, str(n)) if d % 2 == (k == "odd"))
         if any(int(d) % 2 == (k == "odd") for d in str(n)) else 0, _big),
    Task("seconds_to_clock", "seconds", "Return the duration as a string 'H:MM:SS'.", (None,),
         lambda k: lambda s: f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}", lambda rng: (rng.randint(0, 20000),)),
    Task("keep_first_seen", "items", "Return the items without repeats, each at its first position.", (None,),
         lambda k: lambda xs: list(dict.fromkeys(xs)), _ints),
    Task("leap_years", "start, end", "Return the leap years from start to end, both included.", (None,),
         lambda k: lambda a, b: [y for y in range(a, b + 1) if y % 4 == 0 and (y % 100 or y % 400 == 0)],
         lambda rng: (lambda y: (y, y + rng.randint(4, 20)))(rng.randint(1890, 2100))),
    Task("count_bits", "n", "Return how many {k} bits the binary form of n has (without leading zeros).",
         ("1", "0"), lambda k: lambda n: bin(n)[2:].count(k), _big),
    Task("vowels_per_word", "sentence", "Return a list with the number of vowels (a, e, i, o, u) in each word.",
         (None,), lambda k: lambda s: [sum(c in "aeiou" for c in w) for w in s.split()], _sentence),
    Task("capitalize_long_words", "sentence", "Capitalize the first letter of every word with at least {k} "
         "letters; leave the other words as they are.", (4, 5),
         lambda k: lambda s: " ".join(w.capitalize() if len(w) >= k else w for w in s.split()), _sentence),
    Task("alternate_case", "text", "Return the text with its letters in alternating case, the first letter in "
         "{k} case; spaces are kept and do not count.", ("upper", "lower"), _alternate, _sentence),
    Task("split_even_odd", "numbers", "Return two lists: the even numbers and the odd numbers, each in its "
         "original order.", (None,), lambda k: lambda xs: ([x for x in xs if x % 2 == 0], [x for x in xs if x % 2]),
         _ints),
    Task("count_in_range", "numbers, low, high", "Count the numbers x of the list with low <= x <= high.", (None,),
         lambda k: lambda xs, lo, hi: sum(lo <= x <= hi for x in xs),
         lambda rng: _ints(rng) + tuple(sorted(rng.sample(range(41), 2)))),
    Task("times_table", "n", "Return the first {k} lines of the multiplication table of n, as strings like "
         "'3 x 4 = 12'.", (3, 4), lambda k: lambda n: [f"{n} x {i} = {n * i}" for i in range(1, k + 1)], _int),
    Task("squares_below", "n", "Return the perfect squares smaller than n, in increasing order.", (None,),
         lambda k: lambda n: [i * i for i in range(math.isqrt(n - 1) + 1)] if n > 0 else [], _int),
    Task("divisors", "n", "Return the sorted list of the positive divisors of n.", (None,),
         lambda k: lambda n: [d for d in range(1, n + 1) if n % d == 0], _int),
    Task("is_perfect", "n", "Return True if n is the sum of its divisors smaller than itself.", (None,),
         lambda k: lambda n: n == sum(d for d in range(1, n) if n % d == 0),
         lambda rng: (rng.choice((6, 28, 496, 12, 20, 30, 8128, 100)),)),
    Task("triangle_kind", "a, b, c", "Return 'equilateral', 'isosceles' or 'scalene' for a triangle with sides "
         "a, b and c, or 'invalid' if no triangle has those sides.", (None,), lambda k: _triangle,
         lambda rng: tuple(rng.randint(1, 6) for _ in range(3))),
    Task("missing_number", "numbers", "The list holds each of the numbers 1 to n once, except one of them; "
         "return the missing one.", (None,), lambda k: lambda xs: (len(xs) + 1) * (len(xs) + 2) // 2 - sum(xs),
         lambda rng: (lambda xs: (rng.sample(xs, len(xs))[1:],))(list(range(1, rng.randint(4, 9))))),
    Task("flatten_once", "nested", "Flatten a list of lists by one level.", (None,),
         lambda k: lambda m: [x for row in m for x in row], _matrix),
    Task("longest_word", "sentence", "Return the longest word of the sentence; on a tie, the {k} one.",
         ("first", "last"), lambda k: lambda s: max(s.split()[:: 1 if k == "first" else -1], key=len), _sentence),
    Task("mean_rounded", "numbers", "Return the mean of the numbers rounded to {k} decimal places.", (1, 2),
         lambda k: lambda xs: round(sum(xs) / len(xs), k), _ints),
    Task("sorted_digits", "n", "Return the integer whose digits are those of n in {k} order.",
         ("ascending", "descending"),
         lambda k: lambda n: int("".join(sorted(str(n), reverse=k == "descending"))), _big),
    Task("values_seen", "items", "Return how many distinct values occur exactly {k} times in the list.", (1, 2),
         lambda k: lambda xs: sum(c == k for c in Counter(xs).values()),
         lambda rng: ([rng.randint(0, 6) for _ in range(rng.randint(5, 9))],)),
    Task("zero_padded", "numbers", "Return the numbers as strings, each padded with leading zeros to {k} digits.",
         (3, 4), lambda k: lambda xs: [str(x).zfill(k) for x in xs], _ints),
    Task("swap_neighbours", "items", "Swap each pair of neighbouring items (the first with the second, the third "
         "with the fourth, ...); an odd last item stays where it is.", (None,),
         lambda k: lambda xs: [x for i in range(0, len(xs), 2) for x in xs[i : i + 2][::-1]], _ints),
    Task("diagonal_sum", "matrix", "Return the sum of the main diagonal of the square matrix.", (None,),
         lambda k: lambda m: sum(m[i][i] for i in range(len(m))),
         lambda rng: (lambda n: ([[rng.randint(0, 9) for _ in range(n)] for _ in range(n)],))(rng.randint(2, 4))),
    Task("staircase", "n", "Return a list of n strings: the i-th (from 1) is i '{k}' characters, right-aligned to "
         "width n.", ("#", "*"), lambda k: lambda n: [(k * i).rjust(n) for i in range(1, n + 1)],
         lambda rng: (rng.randint(2, 5),)),
    Task("nearest_multiple", "n", "Return the multiple of {k} nearest to n; on a tie, the larger one.", (5, 10),
         lambda k: lambda n: n - n % k + k * (2 * (n % k) >= k), _big),
)  # fmt: skip
