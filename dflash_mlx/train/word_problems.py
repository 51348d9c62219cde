"""Word problems of kinds the `math` source does not write (round 6, `fresh_prompts`).

Nineteen kinds (change, ages, averages, fractions, time, units, remainders, ratios, speed,
interest, geometry, sequences, rates, probability, common multiples and divisors, ...),
each a template whose numbers are drawn so that the problem makes sense (change from a
bill that covers the price, a ratio that divides evenly) and with names and things of
their own, not the `math` source's.
"""

from __future__ import annotations

import random
from typing import Callable

_NAMES = (
    "Aisha Bruno Chloe Diego Elena Felix Gita Hamza Isla Jonas Keiko Liam Maya Nikolai Olga Pablo Quinn Rosa Soren "
    "Thandi Uma Victor Wen Yusuf"
).split()
_THINGS = ("notebooks", "muffins", "tickets", "plants", "batteries", "candles", "buttons", "seashells", "crayons")
_WANTS = ("bike", "guitar", "tablet", "telescope", "skateboard", "camera", "tent")


def _change(rng: random.Random, a: str, b: str) -> str:
    n, price = rng.randint(2, 9), rng.randint(2, 12)
    bill = next(v for v in (10, 20, 50, 100, 200) if v >= n * price)
    item = rng.choice(_THINGS)
    return f"{a} buys {n} {item} at ${price} each and pays with a ${bill} bill. How much change does {a} get?"


def _ages(rng: random.Random, a: str, b: str) -> str:
    x, k, y = rng.randint(5, 40), rng.randint(2, 15), rng.randint(2, 10)
    return f"{a} is {x} years old. {b} is {k} years older than {a}. How old will {b} be in {y} years?"


def _average(rng: random.Random, a: str, b: str) -> str:
    scores = [rng.randint(55, 100) for _ in range(rng.randint(3, 5))]
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    return f"{a}'s test scores are {listed}. What is {a}'s average score?"


def _fraction(rng: random.Random, a: str, b: str) -> str:
    q = rng.randint(3, 8)
    p, n = rng.randint(1, q - 1), q * rng.randint(3, 10)
    return f"There are {n} students in a class. {p}/{q} of them walk to school. How many students do not walk?"


def _clock(rng: random.Random, a: str, b: str) -> str:
    h, m, d = rng.randint(1, 11), rng.choice(range(0, 60, 5)), rng.randint(35, 190)
    return f"A movie starts at {h}:{m:02d} pm and lasts {d} minutes. At what time does it end?"


def _units(rng: random.Random, a: str, b: str) -> str:
    x = rng.randint(2, 95)
    return rng.choice(
        (
            f"How many centimeters are in {x} meters?",
            f"How many grams are in {x / 4:g} kilograms?",
            f"How many minutes are in {x} hours?",
            f"{a} walked {x * 100} meters. How many kilometers is that?",
            f"A jug holds {x / 2:g} liters. How many milliliters is that?",
        )
    )


def _remainder(rng: random.Random, a: str, b: str) -> str:
    k = rng.randint(3, 12)
    n = k * rng.randint(2, 15) + rng.randint(1, k - 1)
    item = rng.choice(_THINGS)
    return f"{n} {item} are packed into bags of {k}. How many full bags are there, and how many {item} are left over?"


def _ratio(rng: random.Random, a: str, b: str) -> str:
    p, q, m = rng.randint(1, 7), rng.randint(1, 7), rng.randint(2, 9)
    return f"The ratio of cats to dogs at a shelter is {p}:{q}. If there are {p * m} cats, how many dogs are there?"


def _speed(rng: random.Random, a: str, b: str) -> str:
    t, v = rng.randint(2, 6), rng.randint(8, 25)
    return f"{a} cycles {t * v} km in {t} hours. What is {a}'s average speed?"


def _interest(rng: random.Random, a: str, b: str) -> str:
    principal, rate, years = rng.choice(range(200, 5001, 100)), rng.randint(2, 8), rng.randint(2, 6)
    return (
        f"{a} puts ${principal} in a savings account that pays {rate}% simple interest per year. "
        f"How much interest does {a} earn in {years} years?"
    )


def _geometry(rng: random.Random, a: str, b: str) -> str:
    x, y, z = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 20)
    return rng.choice(
        (
            f"A circle has a radius of {x} cm. What is its area? Use 3.14 for pi.",
            f"Two angles of a triangle measure {x * 4} and {y * 3} degrees. What is the third angle?",
            f"A box is {x} cm long, {y} cm wide and {z} cm tall. What is its volume?",
            f"A square garden has a perimeter of {x * 4} meters. What is its area?",
        )
    )


def _sequence(rng: random.Random, a: str, b: str) -> str:
    start, step = rng.randint(1, 30), rng.randint(2, 12)
    if rng.random() < 0.5:
        terms = [start + i * step for i in range(4)]
    else:
        terms = [start * (step % 3 + 2) ** i for i in range(4)]
    return f"What is the next number in the sequence {', '.join(map(str, terms))}?"


def _shopping(rng: random.Random, a: str, b: str) -> str:
    n1, p1, n2, p2 = rng.randint(2, 8), rng.randint(2, 15), rng.randint(2, 8), rng.randint(2, 15)
    first, second = rng.sample(_THINGS, 2)
    return f"{a} buys {n1} {first} for ${p1} each and {n2} {second} for ${p2} each. How much does {a} spend in total?"


def _reading(rng: random.Random, a: str, b: str) -> str:
    per_day, pages = rng.randint(8, 40), rng.randint(90, 450)
    return f"A book has {pages} pages. {a} reads {per_day} pages a day. How many days does it take to finish the book?"


def _saving(rng: random.Random, a: str, b: str) -> str:
    weekly, cost = rng.randint(5, 30), rng.randint(60, 600)
    want = rng.choice(_WANTS)
    return f"{a} wants a {want} that costs ${cost} and saves ${weekly} a week. How many weeks until {a} can buy it?"


def _two_numbers(rng: random.Random, a: str, b: str) -> str:
    x, y = rng.randint(5, 80), rng.randint(1, 40)
    if rng.random() < 0.5:
        return f"The sum of two numbers is {2 * x + y} and their difference is {y}. What are the numbers?"
    k = rng.choice((2, 3))
    return f"If {y} more than {('twice', 'three times')[k - 2]} a number is {k * x + y}, what is the number?"


def _probability(rng: random.Random, a: str, b: str) -> str:
    r, bl, g = rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 12)
    return (
        f"A bag has {r} red, {bl} blue and {g} green marbles. What is the probability of picking a blue one at random?"
    )


def _common(rng: random.Random, a: str, b: str) -> str:
    x, y = rng.randint(2, 12), rng.randint(2, 12)
    if rng.random() < 0.5:
        return (
            f"{a} visits the library every {x} days and {b} every {y} days. They were both there today. "
            f"In how many days will they next be there on the same day?"
        )
    m = rng.randint(2, 9)
    return (
        f"{a} has {x * m} red flowers and {y * m} white flowers and wants identical bouquets that use all of them. "
        f"What is the greatest number of bouquets {a} can make?"
    )


def _price_steps(rng: random.Random, a: str, b: str) -> str:
    price, off, tax = rng.randint(20, 300), rng.choice((10, 15, 20, 25, 30)), rng.choice((5, 8, 10))
    return (
        f"A {rng.choice(_WANTS)} costs ${price}. It is {off}% off, then {tax}% tax is added. What is the final price?"
    )


KINDS: tuple[Callable[[random.Random, str, str], str], ...] = (
    _change,
    _ages,
    _average,
    _fraction,
    _clock,
    _units,
    _remainder,
    _ratio,
    _speed,
    _interest,
    _geometry,
    _sequence,
    _shopping,
    _reading,
    _saving,
    _two_numbers,
    _probability,
    _common,
    _price_steps,
)


def word_problem(rng: random.Random) -> str:
    """A word problem of one of `KINDS`, with two people's names and numbers drawn from `rng`."""
    a, b = rng.sample(_NAMES, 2)
    return rng.choice(KINDS)(rng, a, b)
