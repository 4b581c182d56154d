"""Grade-school math word problems, generated: the ``word-problems`` training source.

The generated math of `reasoning-gym` is mostly symbolic ("Calculate 4,812 / 12", "Simplify 35/63"), while a
user's math questions, and the project's math eval set, are stories: people, things, prices, rates. A
drafter trained on the former predicted the target's worked answers to its own held-out math at τ̂ 6.19 but
the eval's word problems at 2.99 (teacher-forced; docs/results.md, 'The target's own math word problems').
These 35 templates are narratives over everyday quantities, each problem made from its own seed, with its
answer; with the ``:steps`` option the problem asks for a worked solution (`worked_math.STEPS_REQUEST`).

None of the templates is one of the eval set's five problem types (`dflash_train.prompts.math_eval_set`: change
from a payment, sharing with four friends, distance at a speed, weekly pay, a percent discount on boxes),
so the eval still measures word problems of kinds the drafter never trained on; `prepare`'s 13-word
decontamination check holds for them too (tested).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

NAMES = ("Maya", "Tomas", "Priya", "Oskar", "Nia", "Liam", "Sofia", "Kenji", "Amara", "Mateo", "Yara", "Elias",
         "Zoe", "Ravi", "Ines", "Theo", "Leila", "Bruno", "Aiko", "Samir")
Problem = tuple[str, float]  # the question, its answer


def _garden_fence(r: random.Random, name: str) -> Problem:
    length, width, cost = r.randint(6, 30), r.randint(4, 20), r.randint(3, 12)
    return (f"{name}'s rectangular garden is {length} meters long and {width} meters wide. Fencing costs ${cost} "
            f"per meter. What does it cost to fence the whole garden?", 2 * (length + width) * cost)


def _paint_cans(r: random.Random, name: str) -> Problem:
    walls, area, cover = r.randint(2, 6), r.randint(60, 140), r.choice((100, 150, 200, 250))
    return (f"{name} is painting {walls} walls, each with an area of {area} square feet. One can of paint covers "
            f"{cover} square feet. How many cans does {name} need to buy?", math.ceil(walls * area / cover))


def _recipe_scale(r: random.Random, name: str) -> Problem:
    serves, amount = r.choice((4, 6, 8)), r.randint(2, 6)
    wanted = serves * r.choice((1, 3, 4, 5)) // 2
    dish, unit = r.choice(("soup", "stew", "curry", "porridge", "bread")), r.choice(("cups", "tablespoons"))
    food = r.choice(("lentils", "flour", "rice", "milk", "oats", "butter"))
    return (f"A {dish} recipe that serves {serves} people uses {amount} {unit} of {food}. {name} wants to make "
            f"{dish} for {wanted} people. How many {unit} of {food} are needed?", amount * wanted / serves)


def _reading_plan(r: random.Random, name: str) -> Problem:
    weekday, weekend, weeks = r.randint(10, 40), r.randint(30, 80), r.randint(2, 6)
    return (f"{name} reads {weekday} pages every weekday and {weekend} pages on each day of the weekend. How many "
            f"pages does {name} read in {weeks} weeks?", weeks * (5 * weekday + 2 * weekend))


def _savings_goal(r: random.Random, name: str) -> Problem:
    saved, weekly, price = r.randint(10, 80), r.randint(5, 25), r.randint(120, 400)
    return (f"{name} has saved ${saved} and puts aside ${weekly} every week. A bicycle costs ${price}. After how "
            f"many weeks can {name} first afford it?", max(0, math.ceil((price - saved) / weekly)))


def _bake_sale(r: random.Random, name: str) -> Problem:
    muffins, muffin_price, pies, pie_price, costs = (r.randint(20, 60), r.randint(1, 3), r.randint(4, 12),
                                                     r.randint(6, 15), r.randint(20, 60))
    return (f"At a bake sale {name} sells {muffins} muffins at ${muffin_price} each and {pies} pies at "
            f"${pie_price} each. The ingredients cost ${costs}. What is the profit?",
            muffins * muffin_price + pies * pie_price - costs)


def _ages(r: random.Random, name: str) -> Problem:
    child, times, years = r.randint(4, 15), r.randint(2, 4), r.randint(2, 12)
    total, parent = child * (times + 1) + 2 * years, r.choice(("mother", "father", "aunt", "uncle"))
    return (f"{name}'s {parent} is {times} times as old as {name}. In {years} years their ages will add up to "
            f"{total}. How old is {name} now?", child)


def _test_average(r: random.Random, name: str) -> Problem:
    scores = [r.randint(70, 95) for _ in range(4)]
    needed = r.choice([n for n in range(60, 101) if (sum(scores) + n) % 5 == 0])
    return (f"{name} scored {', '.join(map(str, scores[:3]))} and {scores[3]} on four tests. What score does "
            f"{name} need on the fifth test for an average of {(sum(scores) + needed) // 5}?", needed)


def _bookshelf(r: random.Random, name: str) -> Problem:
    shelves, per_shelf, new = r.randint(3, 8), r.randint(12, 30), r.randint(15, 90)
    return (f"{name}'s bookcase has {shelves} shelves that each hold {per_shelf} books, and all of them are full. "
            f"{name} gets {new} new books. How many more shelves of the same size are needed?",
            math.ceil(new / per_shelf))


def _water_tank(r: random.Random, name: str) -> Problem:
    fill, leak = r.randint(12, 30), r.randint(2, 8)
    minutes = r.randint(10, 40)
    return (f"A tank holds {(fill - leak) * minutes} liters. {name} fills it with a hose that adds {fill} liters a "
            f"minute, but a crack leaks {leak} liters a minute. How many minutes until the empty tank is full?",
            minutes)


def _class_groups(r: random.Random, name: str) -> Problem:
    size = r.randint(3, 7)
    students = size * r.randint(4, 12) + r.randint(1, size - 1)
    place, leader = r.choice((("class", "teacher"), ("choir", "director"), ("camp", "counselor"), ("club", "coach")))
    return (f"{name}'s {place} has {students} children. The {leader} makes as many groups of {size} as possible. "
            f"How many children are left without a full group?", students % size)


FRACTIONS = {2: "one half", 3: "one third", 4: "one quarter", 5: "one fifth", 6: "one sixth"}
FRUITS = ("pears", "plums", "figs", "peaches", "apricots", "lemons", "kiwis")


def _fruit_basket(r: random.Random, name: str) -> Problem:
    first, second = r.choice(((3, 4), (2, 5), (4, 6), (3, 5), (2, 6), (5, 6), (4, 5)))
    total = math.lcm(first, second) * r.randint(2, 9)
    a, b, c = r.sample(FRUITS, 3)
    return (f"{name} has a basket of {total} pieces of fruit. {FRACTIONS[first].capitalize()} are {a} and "
            f"{FRACTIONS[second]} are {b}; the rest are {c}. How many {c} are there?",
            total - total // first - total // second)


def _parking_lot(r: random.Random, name: str) -> Problem:
    rows, spots, percent = r.randint(5, 20), r.randint(10, 30), r.choice((25, 40, 60, 75, 80))
    total = rows * spots
    return (f"The parking lot where {name} works has {rows} rows of {spots} spaces. {percent}% of the spaces are "
            f"taken. How many spaces are free?", total - total * percent / 100)


def _running_laps(r: random.Random, name: str) -> Problem:
    lap, laps, days = r.choice((200, 250, 300, 400, 500)), r.randint(4, 15), r.randint(3, 10)
    return (f"{name} runs {laps} laps of a {lap}-meter track each day for {days} days. How many kilometers is "
            f"that?", lap * laps * days / 1000)


def _ticket_mix(r: random.Random, name: str) -> Problem:
    adult, child = r.randint(8, 15), r.randint(3, 7)
    adults, children = r.randint(10, 60), r.randint(10, 60)
    return (f"A museum charges ${adult} for adults and ${child} for children. {name} sold {adults + children} "
            f"tickets for ${adult * adults + child * children} in total. How many adult tickets were sold?", adults)


def _floor_tiles(r: random.Random, name: str) -> Problem:
    length, width, box, price = r.randint(4, 12) * 2, r.randint(3, 10) * 2, r.choice((5, 8, 10)), r.randint(15, 40)
    tiles = length * width // 4
    return (f"{name} covers a floor {length} feet by {width} feet with square tiles 2 feet on a side. Tiles come "
            f"in boxes of {box} for ${price} a box. How much do the tiles cost?", math.ceil(tiles / box) * price)


def _bus_riders(r: random.Random, name: str) -> Problem:
    start, on1, off1 = r.randint(10, 30), r.randint(3, 12), r.randint(2, 9)
    on2, off2 = r.randint(3, 12), r.randint(2, 9)
    return (f"{name}'s bus starts with {start} riders. At the first stop {off1} get off and {on1} get on. At the "
            f"second stop {off2} get off and {on2} get on. How many riders are on the bus now?",
            start - off1 + on1 - off2 + on2)


def _temperature(r: random.Random, name: str) -> Problem:
    morning, rise, hours, fall = r.randint(-5, 15), r.randint(1, 4), r.randint(3, 7), r.randint(3, 12)
    return (f"When {name} woke up it was {morning} degrees. It warmed by {rise} degrees an hour for {hours} hours, "
            f"then cooled by {fall} degrees by night. What was the temperature at night?", morning + rise * hours - fall)


def _library_fines(r: random.Random, name: str) -> Problem:
    books, days, cents = r.randint(2, 6), r.randint(3, 21), r.choice((5, 10, 15, 20, 25, 50))
    return (f"{name} returned {books} library books {days} days late. The fine is {cents} cents per book per day. "
            f"How many dollars does {name} owe?", books * days * cents / 100)


def _phone_bill(r: random.Random, name: str) -> Problem:
    fee, limit, extra = r.randint(15, 40), r.randint(2, 10), r.randint(3, 10)
    used = limit + r.randint(1, 6)
    return (f"{name}'s phone plan costs ${fee} a month with {limit} GB of data included; each extra GB costs "
            f"${extra}. {name} used {used} GB this month. What is the bill?", fee + (used - limit) * extra)


def _training_miles(r: random.Random, name: str) -> Problem:
    start, step, weeks = r.randint(5, 20), r.randint(1, 5), r.randint(4, 12)
    return (f"{name} runs {start} miles in the first week of training and {step} more miles each week than the "
            f"week before. How many miles does {name} run in {weeks} weeks?",
            weeks * start + step * weeks * (weeks - 1) // 2)


def _pizza_party(r: random.Random, name: str) -> Problem:
    kids, slices, price, per_pizza = r.randint(8, 30), r.randint(2, 4), r.randint(9, 16), r.choice((6, 8, 10, 12))
    return (f"{name} is ordering pizza for {kids} children. Each child eats {slices} slices and each pizza has "
            f"{per_pizza} slices. Pizzas cost ${price}. How much will the pizza cost?",
            math.ceil(kids * slices / per_pizza) * price)


def _coin_jar(r: random.Random, name: str) -> Problem:
    quarters, dimes, nickels = r.randint(5, 40), r.randint(5, 40), r.randint(5, 40)
    return (f"{name}'s jar holds {quarters} quarters, {dimes} dimes and {nickels} nickels. How much money is in the "
            f"jar in dollars?", (25 * quarters + 10 * dimes + 5 * nickels) / 100)


def _orchard(r: random.Random, name: str) -> Problem:
    trees, apples, bad, bag = r.randint(6, 20), r.randint(30, 80), r.randint(5, 40), r.choice((6, 8, 10, 12))
    good = trees * apples - bad
    return (f"{name} picks {apples} apples from each of {trees} trees and throws away {bad} bruised ones. The "
            f"rest go into bags of {bag}. How many full bags does {name} fill?", good // bag)


def _printer_job(r: random.Random, name: str) -> Problem:
    rate, jams, fix = r.randint(10, 40), r.randint(2, 4), r.randint(2, 6)
    pages = rate * r.randint(5, 20)
    return (f"{name}'s printer prints {rate} pages a minute. A {pages}-page report jams {jams} times, and each "
            f"jam takes {fix} minutes to clear. How long does the report take?", pages // rate + jams * fix)


def _car_wash(r: random.Random, name: str) -> Problem:
    members = r.randint(3, 8)
    cars, price, donations = r.randint(20, 60), r.randint(5, 12), r.randint(10, 90)
    total = cars * price + donations
    total += (-total) % members
    donations = total - cars * price
    return (f"{name}'s team washed {cars} cars at ${price} each and got ${donations} in donations. They split the "
            f"money equally among {members} members. How much does each get?", total // members)


def _fish_food(r: random.Random, name: str) -> Problem:
    fish, grams, box = r.randint(3, 12), r.randint(2, 6), r.randint(100, 500)
    return (f"{name} has {fish} fish, and each eats {grams} grams of food a day. A box holds {box} grams. For how "
            f"many full days does one box last?", box // (fish * grams))


def _stadium(r: random.Random, name: str) -> Problem:
    seats, percent, fewer = r.randint(20, 80) * 1000, r.choice((50, 60, 75, 90)), r.randint(1, 9) * 500
    saturday = seats * percent // 100
    return (f"The stadium {name} visits has {seats} seats. On Saturday {percent}% of them were filled, and on "
            f"Sunday {fewer} fewer people came than on Saturday. How many people came over the two days?",
            2 * saturday - fewer)


def _ribbon(r: random.Random, name: str) -> Problem:
    piece, length = r.randint(12, 35), r.randint(150, 500)
    return (f"{name} cuts a ribbon {length} centimeters long into pieces of {piece} centimeters. How many "
            f"centimeters are left over?", length % piece)


def _commute(r: random.Random, name: str) -> Problem:
    walk, bus, days = r.randint(5, 20), r.randint(10, 40), r.choice((4, 5, 6))
    return (f"Each way to school, {name} walks for {walk} minutes and then rides a bus for {bus} minutes. How many "
            f"hours does {name} spend commuting in a {days}-day week, there and back?", 2 * days * (walk + bus) / 60)


def _elevator(r: random.Random, name: str) -> Problem:
    limit, person, cargo = r.choice((600, 800, 1000)), r.randint(65, 90), r.randint(50, 200)
    return (f"An elevator can carry {limit} kilograms. {name} loads {cargo} kilograms of boxes into it. If each "
            f"person weighs {person} kilograms, how many people can ride along?", (limit - cargo) // person)


def _seed_packets(r: random.Random, name: str) -> Problem:
    rows, per_row, packet = r.randint(4, 12), r.randint(8, 25), r.choice((20, 25, 30, 50))
    return (f"{name} plants {rows} rows of carrots with {per_row} seeds in each row. Seeds come in packets of "
            f"{packet}. How many packets does {name} need?", math.ceil(rows * per_row / packet))


def _stamp_album(r: random.Random, name: str) -> Problem:
    have, buy, give, months = r.randint(20, 120), r.randint(8, 20), r.randint(1, 7), r.randint(3, 12)
    return (f"{name} has {have} stamps, buys {buy} more every month and gives {give} to a friend every month. How "
            f"many stamps will {name} have after {months} months?", have + months * (buy - give))


def _phone_battery(r: random.Random, name: str) -> Problem:
    video, idle, hours_video = r.randint(10, 20), r.randint(2, 5), r.randint(2, 4)
    hours_idle = r.randint(2, max(2, min(6, (95 - video * hours_video) // idle)))
    return (f"{name}'s phone starts the day fully charged. Watching videos uses {video}% of the battery an hour and "
            f"standing by uses {idle}% an hour. After {hours_video} hours of videos and {hours_idle} hours on "
            f"standby, what percent is left?", 100 - video * hours_video - idle * hours_idle)


def _movie_marathon(r: random.Random, name: str) -> Problem:
    films, pause, hour = [r.randint(85, 150) for _ in range(3)], r.randint(10, 30), r.randint(12, 17)
    end = hour * 60 + sum(films) + 2 * pause
    return (f"{name} starts a movie marathon at {hour}:00 with films of {films[0]}, {films[1]} and {films[2]} "
            f"minutes and a {pause}-minute break between films. At what time does it end?", end)


TEMPLATES: tuple[Callable[[random.Random, str], Problem], ...] = (
    _garden_fence, _paint_cans, _recipe_scale, _reading_plan, _savings_goal, _bake_sale, _ages, _test_average,
    _bookshelf, _water_tank, _class_groups, _fruit_basket, _parking_lot, _running_laps, _ticket_mix,
    _floor_tiles, _bus_riders, _temperature, _library_fines, _phone_bill, _training_miles, _pizza_party,
    _coin_jar, _orchard, _printer_job, _car_wash, _fish_food, _stadium, _ribbon, _commute, _elevator,
    _seed_packets, _stamp_album, _phone_battery, _movie_marathon,
)


def word_problem(index: int, seed: int = 0) -> dict[str, object]:
    """Problem ``index`` of the stream with ``seed``: the templates in turn, each problem from its own
    generator (the same problem whatever else is read). Times of day are answered in minutes after midnight."""
    template = TEMPLATES[index % len(TEMPLATES)]
    rng = random.Random(f"word-problems:{seed}:{index}")
    question, answer = template(rng, rng.choice(NAMES))
    return {"question": question, "answer": answer, "task": template.__name__.lstrip("_")}
