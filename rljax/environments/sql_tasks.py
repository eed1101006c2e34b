"""SQL tasks: a fresh SQLite database per episode, a question, a gold query; the model's SQL runs
read-only with a time limit and is right when its result set equals the gold query's on every
database of the question's test suite.

    examples = make_task("sql", split="train", size=100, seed=0)   # registered data task "sql"
    check = check_sql(extract_sql(completion), examples[0])         # -> SqlCheck(correct, message, result)
    reward = float(check.correct)                                   # registered reward "sql_result"
    # reward "sql_executes": 1.0 for a query that runs without error (a shaping term for small models)

Each example holds `setup` (the CREATE TABLE and INSERT statements of its own database: 10-20 rows
of generated employees, or customers and their orders), `schema` (the CREATE TABLE statements the
prompt shows), `prompt` (schema, question, how to reply), `answer` (the gold query), `ordered`
(whether the question asks for an order), `test_setups` (the test suite's other databases), `task`,
`key`. The key is the question with its parameters and the database's seed, so the train / eval split
is by question (`question_split`).

The test suite (test-suite execution accuracy, Zhong et al. 2020, arXiv:2010.02840): one database
lets wrong queries through (`SELECT 2` on a count question whose answer is 2, a wrong filter whose
count coincides, `SELECT 1 WHERE 0` when the gold result is empty, as it is for 11 of the 300
training questions of seed 0). So each question carries `TEST_SUITE_SIZE` databases of the same
schema (`draw_test_suite`): the prompt's, then databases drawn from seeds derived from the question
and its database seed, with the gold query's constants (department, city, year, salary and age bounds
and their neighbours) planted in some rows, each kept only when the gold result there differs from
the gold result on every database kept before. `check_sql` accepts a query only when its result
equals the gold query's on all of them. On 3,616 wrong queries generated over those 300 questions
(constants, the prompt database's answer hard-coded, empty selects, dropped, negated or off-by-one
filters, another department or city, other aggregates, orders and limits;
`tests/unit/test_sql_test_suite.py`), one database accepts 18.2% (658) and the test suite 0.03% (1:
an ORDER BY dropped where every database's rows happen to come out in name order); gold queries
and rewritings of them (`COUNT(id)`, `salary >= t + 1`, ...) score 1.0 on every question.

How the model's query runs (`run_sql`), on an in-memory database built from `setup` just for it:

- read-only: `PRAGMA query_only = ON` and an authorizer that allows only reading (SELECT, reading
  columns, functions, recursive CTEs) and denies everything else (writes, PRAGMA, ATTACH, which
  could create a file, transactions); denied SQL fails with "not authorized";
- one statement only (sqlite3 refuses several);
- a time limit: a progress handler (every 1,000 virtual-machine steps) aborts the query past
  `timeout_s` ("interrupted"), so a runaway recursive CTE or a huge cross join ends (`check_sql`
  gives the query `timeout_s` on all the suite's databases together);
- bounded results: at most `max_rows` rows are fetched (more is an error), strings and blobs at most
  1 MB each (SQLITE_LIMIT_LENGTH), the SQL text at most 100 kB.
It runs in the trainer's process (no sandbox process: SQLite is the sandbox); memory is bounded by
the time limit and the limits above, not by an rlimit.

Result comparison, on each database: the rows of the model's query against the gold query's, each value normalised
(a float with an integral value is that int, other floats are rounded to 6 places), as multisets, or
as lists when `ordered`. Column names are ignored; the number of columns must match.

SQL extraction (`extract_sql`): the last ```sql (or bare ```) fenced block (an unclosed last fence
runs to the end), else the last <answer>...</answer>, else None (reward 0); of several statements
there, the last SELECT / WITH one.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import sqlite3
import time
from collections import Counter
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from rljax.data.tasks import question_split, register_task
from rljax.rewards.base import check_batch, register_reward

DEFAULT_INSTRUCTION = "Reply with one SQLite query in a ```sql code block."
_NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Milo", "Nora",
          "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Vic", "Wren", "Xena", "Yuri", "Zoe", "Alba",
          "Bo", "Cyrus", "Dina", "Elio", "Faye", "Gil", "Hugo", "Iris", "Jonas", "Kira", "Leo", "Mara", "Nils")
_DEPARTMENTS = ("Sales", "Engineering", "Marketing", "Support", "Finance", "Legal")
_CITIES = ("Lisbon", "Oslo", "Lima", "Cairo", "Osaka", "Quito", "Perth", "Accra")
_EMPLOYEES = "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT, salary INTEGER, age INTEGER)"
_CUSTOMERS = "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT)"
_ORDERS = "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, amount INTEGER, year INTEGER)"

def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & 0x7FFF_FFFF


def _quote(value: Any) -> str:
    return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else str(value)


def _inserts(table: str, rows: list[tuple]) -> list[str]:
    return [f"INSERT INTO {table} VALUES ({', '.join(_quote(v) for v in row)})" for row in rows]


# ---------------------------------------------------------------------------------------------
# Databases and questions


def _employees_db(rng: np.random.Generator, plant: Mapping[str, Any] | None = None) -> tuple[list[str], dict]:
    n = int(rng.integers(10, 17))
    names = [_NAMES[int(i)] for i in rng.choice(len(_NAMES), size=n, replace=False)]
    departments = [_DEPARTMENTS[int(i)] for i in rng.choice(len(_DEPARTMENTS), size=int(rng.integers(3, 5)), replace=False)]
    salaries = [int(s) * 1000 for s in rng.choice(np.arange(30, 151), size=n, replace=False)]  # distinct: no ties
    rows = [(i + 1, names[i], departments[int(rng.integers(0, len(departments)))], salaries[i],
             int(rng.integers(21, 66))) for i in range(n)]
    if plant:
        rows = _plant_employees(rng, rows, plant)
    return [_EMPLOYEES, *_inserts("employees", rows)], {"rows": rows, "departments": sorted({r[2] for r in rows})}


def _orders_db(rng: np.random.Generator, plant: Mapping[str, Any] | None = None) -> tuple[list[str], dict]:
    n_customers, n_orders = int(rng.integers(5, 9)), int(rng.integers(10, 21))
    names = [_NAMES[int(i)] for i in rng.choice(len(_NAMES), size=n_customers, replace=False)]
    cities = [_CITIES[int(i)] for i in rng.choice(len(_CITIES), size=3, replace=False)]
    customers = [(i + 1, names[i], cities[int(rng.integers(0, 3))]) for i in range(n_customers)]
    buyers = [c[0] for c in customers if rng.random() < 0.8] or [1]  # some customers never order
    orders = [(i + 1, buyers[int(rng.integers(0, len(buyers)))], int(rng.integers(5, 500)),
               int(rng.integers(2019, 2025))) for i in range(n_orders)]
    if plant:
        customers, orders = _plant_orders(rng, customers, orders, plant)
    setup = [_CUSTOMERS, _ORDERS, *_inserts("customers", customers), *_inserts("orders", orders)]
    cities_with_orders = sorted({customers[o[1] - 1][2] for o in orders})
    return setup, {"customers": customers, "orders": orders, "cities": cities_with_orders,
                   "years": sorted({o[3] for o in orders})}


def _plant_employees(rng: np.random.Generator, rows: list[tuple], plant: Mapping[str, Any]) -> list[tuple]:
    """`rows` with the gold query's constants planted, each with probability 0.6: 1-4 employees moved
    to its department; its salary threshold and each neighbour (± 1000) given to one employee each
    (salaries stay distinct); its age bound and each neighbour (± 1) likewise; so that a filter the
    model got slightly wrong (`>=` for `>`, off by one, another department) meets a row that tells
    the two apart on some database."""
    rows = [list(r) for r in rows]
    if "department" in plant and rng.random() < 0.6:
        for i in rng.choice(len(rows), size=min(len(rows), int(rng.integers(1, 5))), replace=False):
            rows[int(i)][2] = plant["department"]
    if "salary" in plant or "age" in plant:
        salary_rows, age_rows = rng.choice(len(rows), size=3, replace=False), rng.choice(len(rows), size=3, replace=False)
        for step, i, j in zip((-1, 0, 1), salary_rows, age_rows):
            if "salary" in plant and rng.random() < 0.6:
                target, i = int(plant["salary"]) + 1000 * step, int(i)
                for other in rows:  # keep salaries distinct: swap with the row that already has it
                    if other[3] == target:
                        other[3] = rows[i][3]
                rows[i][3] = target
            if "age" in plant and rng.random() < 0.6:
                rows[int(j)][4] = int(plant["age"]) + step
    return [tuple(r) for r in rows]


def _plant_orders(rng: np.random.Generator, customers: list[tuple], orders: list[tuple],
                  plant: Mapping[str, Any]) -> tuple[list[tuple], list[tuple]]:
    """`customers` and `orders` with the gold query's city and year planted (as `_plant_employees`)."""
    customers, orders = [list(c) for c in customers], [list(o) for o in orders]
    if "city" in plant and rng.random() < 0.6:
        for i in rng.choice(len(customers), size=int(rng.integers(1, 3)), replace=False):
            customers[int(i)][2] = plant["city"]
    if "year" in plant and rng.random() < 0.6:
        for i in rng.choice(len(orders), size=int(rng.integers(1, 4)), replace=False):
            orders[int(i)][3] = int(plant["year"])
    return [tuple(c) for c in customers], [tuple(o) for o in orders]


def _pick(rng, values):
    return values[int(rng.integers(0, len(values)))]


# Each question: (name, database, draw(rng, facts) -> (question, gold SQL, ordered)).
_QUESTIONS = (
    ("count_in_department", "employees", lambda r, f: (lambda d: (
        f"How many employees work in the {d} department?",
        f"SELECT COUNT(*) FROM employees WHERE department = '{d}'", False))(_pick(r, f["departments"]))),
    ("names_above_salary", "employees", lambda r, f: (lambda t: (
        f"List the names of the employees whose salary is above {t}, in alphabetical order.",
        f"SELECT name FROM employees WHERE salary > {t} ORDER BY name", True))(int(r.integers(40, 140)) * 1000)),
    ("average_by_department", "employees", lambda r, f: (
        "What is the average salary in each department? Return each department and its average salary.",
        "SELECT department, AVG(salary) FROM employees GROUP BY department", False)),
    ("top_earners", "employees", lambda r, f: (lambda n: (
        f"Which {n} employees earn the most? Return their names, the highest salary first.",
        f"SELECT name FROM employees ORDER BY salary DESC LIMIT {n}", True))(int(r.integers(2, 5)))),
    ("oldest_in_department", "employees", lambda r, f: (lambda d: (
        f"What is the age of the oldest employee in the {d} department?",
        f"SELECT MAX(age) FROM employees WHERE department = '{d}'", False))(_pick(r, f["departments"]))),
    ("count_younger", "employees", lambda r, f: (lambda a: (
        f"How many employees are younger than {a}?",
        f"SELECT COUNT(*) FROM employees WHERE age < {a}", False))(int(r.integers(25, 60)))),
    ("total_for_city", "orders", lambda r, f: (lambda c: (
        f"What is the total amount of all orders placed by customers from {c}?",
        f"SELECT SUM(orders.amount) FROM orders JOIN customers ON orders.customer_id = customers.id "
        f"WHERE customers.city = '{c}'", False))(_pick(r, f["cities"]))),
    ("customers_without_orders", "orders", lambda r, f: (
        "List the names of the customers who have placed no orders.",
        "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)", False)),
    ("orders_in_year", "orders", lambda r, f: (lambda y: (
        f"How many orders were placed in {y}?",
        f"SELECT COUNT(*) FROM orders WHERE year = {y}", False))(_pick(r, f["years"]))),
    ("orders_per_customer", "orders", lambda r, f: (
        "For each customer who placed at least one order, return the customer's name and the number of "
        "orders they placed.",
        "SELECT customers.name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
        "GROUP BY customers.id", False)),
)
QUESTION_NAMES = tuple(q[0] for q in _QUESTIONS)
_DATABASES = {"employees": _employees_db, "orders": _orders_db}


def make_sql_problem(name: str, db_seed: int, *, instruction: str | None = DEFAULT_INSTRUCTION,
                     test_suite: bool = True) -> dict[str, Any]:
    """The example of question `name` (from `QUESTION_NAMES`) on the database drawn from `db_seed`
    (see the module docstring for its keys); its `key` is what the train / eval split hashes. With
    `test_suite` (default) it also holds `test_setups`, the other databases `check_sql` runs on
    (`draw_test_suite`); without, the example is cheaper to draw (for one about to be discarded)."""
    _, database, draw = _QUESTIONS[QUESTION_NAMES.index(name)]
    setup, facts = _DATABASES[database](np.random.default_rng(db_seed))
    question, gold, ordered = draw(np.random.default_rng(_seed(db_seed, name)), facts)
    schema = [s for s in setup if s.startswith("CREATE")]
    prompt = ("SQLite database:\n" + ";\n".join(schema) + ";\n\nQuestion: " + question
              + (f"\n{instruction}" if instruction else ""))
    example = {"prompt": prompt, "answer": gold, "task": "sql", "key": f"{name}|{question}|db={db_seed}",
               "question": question, "schema": schema, "setup": setup, "ordered": ordered, "template": name}
    if test_suite:
        example["test_setups"] = draw_test_suite(name, db_seed, setup, gold, ordered)
    return example


TEST_SUITE_SIZE = 5  # databases per question, the one the prompt describes included
_MAX_CANDIDATES = 500
_CONSTANT = re.compile(r"(\w+)\s*(?:=|<|>)\s*('(?:[^']|'')*'|\d+)")


def draw_test_suite(name: str, db_seed: int, setup: Sequence[str], gold: str, ordered: bool) -> list[list[str]]:
    """The `TEST_SUITE_SIZE - 1` other databases of question `name` on `db_seed`: the same schema,
    contents drawn from seeds derived from `(db_seed, name)` (so deterministic), with the gold query's
    constants planted in some of them, kept only when the gold query's result there differs from
    its result on every database already kept (`setup`'s first). So the gold results are pairwise
    different: at most one is empty, and a constant, an empty select or a filter that coincides with
    the right one on one database fails on another (test-suite accuracy, arXiv:2010.02840)."""
    generate = _DATABASES[_QUESTIONS[QUESTION_NAMES.index(name)][1]]
    plant = {column: (int(v) if v.isdigit() else v[1:-1].replace("''", "'")) for column, v in _CONSTANT.findall(gold)}
    seen = {_result_key(_gold_rows(tuple(setup), gold), ordered)}
    chosen: list[list[str]] = []
    for k in range(_MAX_CANDIDATES):
        if len(chosen) == TEST_SUITE_SIZE - 1:
            return chosen
        candidate, _ = generate(np.random.default_rng(_seed(db_seed, name, "test suite", k)), plant)
        result = _result_key(_gold_rows(tuple(candidate), gold), ordered)
        if result not in seen:
            seen.add(result)
            chosen.append(candidate)
    raise ValueError(f"sql question {name!r} on db {db_seed}: only {len(chosen) + 1} databases with different "
                     f"gold results in {_MAX_CANDIDATES} candidates (need {TEST_SUITE_SIZE})")


def _sql_task(*, split: str, size: int, seed: int, eval_fraction: float, questions: Sequence[str] | None = None,
              instruction: str | None = DEFAULT_INSTRUCTION, max_draws: int | None = None) -> list[dict[str, Any]]:
    """Data task "sql" (`rljax.data.tasks.register_task`): `size` distinct questions of `split`, each
    on a database of its own. Options: `questions` (names from `QUESTION_NAMES`, default all),
    `instruction` (appended to each prompt), `max_draws`."""
    chosen = [q for q in _QUESTIONS if questions is None or q[0] in questions]
    unknown = sorted(set(questions or ()) - set(QUESTION_NAMES))
    if unknown or not chosen:
        raise ValueError(f"task 'sql': unknown question(s) {unknown or list(questions or ())}; known: {list(QUESTION_NAMES)}")
    rng = np.random.default_rng(_seed(seed, "sql", split))
    limit = max_draws if max_draws is not None else 50 * size + 1000
    examples, seen = [], set()
    for _ in range(limit):
        if len(examples) == size:
            break
        name = chosen[int(rng.integers(0, len(chosen)))][0]
        db_seed = int(rng.integers(0, 2**31 - 1))
        key = make_sql_problem(name, db_seed, instruction=instruction, test_suite=False)["key"]
        if key in seen or question_split(key, task="sql", seed=seed, eval_fraction=eval_fraction) != split:
            continue
        seen.add(key)
        examples.append(make_sql_problem(name, db_seed, instruction=instruction))
    if len(examples) < size:
        raise ValueError(f"task 'sql': found only {len(examples)} distinct {split} questions in {limit} draws")
    return examples


# ---------------------------------------------------------------------------------------------
# Running and checking SQL


class SqlResult(NamedTuple):
    """What `run_sql` returns."""

    rows: list[tuple] | None  # None when the query failed
    columns: tuple[str, ...]
    error: str | None  # "OperationalError: no such column: salry", "timeout after 1 s", ...
    timed_out: bool = False


class SqlCheck(NamedTuple):
    """What `check_sql` returns."""

    correct: bool
    message: str  # for a model that may retry: the error, or how the result differs; "correct" if right
    result: SqlResult  # the model's query's result


_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action: int, *_args) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def open_database(setup: Sequence[str]) -> sqlite3.Connection:
    """A fresh in-memory database with the tables and rows of `setup` (an example's statements)."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    for statement in setup:
        conn.execute(statement)
    conn.commit()
    return conn


def run_sql(setup: Sequence[str] | sqlite3.Connection, query: str, *, timeout_s: float = 1.0,
            max_rows: int = 1000) -> SqlResult:
    """Run one read-only `query` on a fresh database built from `setup` (or on a given connection,
    which is then made read-only for good). Never raises for anything in `query`."""
    conn = open_database(setup) if not isinstance(setup, sqlite3.Connection) else setup
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
        conn.set_authorizer(_authorize)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            cursor = conn.execute(query)
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.OperationalError as exc:
            if str(exc) == "interrupted":
                return SqlResult(None, (), f"timeout after {timeout_s:g} s", True)
            return SqlResult(None, (), f"{type(exc).__name__}: {exc}")
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as exc:
            return SqlResult(None, (), f"{type(exc).__name__}: {exc}")
        columns = tuple(d[0] for d in cursor.description or ())
        if len(rows) > max_rows:
            return SqlResult(None, columns, f"more than {max_rows} rows")
        return SqlResult([tuple(r) for r in rows], columns, None)
    finally:
        conn.set_progress_handler(None, 0)
        if not isinstance(setup, sqlite3.Connection):
            conn.close()


def _normalise(value: Any) -> Any:
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return int(value)
        return round(value, 6)
    return value


def _result_key(rows: Sequence[tuple], ordered: bool) -> tuple:
    """`rows` (normalised) in the form two results compare equal in: a list when `ordered`, else a
    multiset (sorted by repr, so rows of mixed types sort)."""
    return tuple(rows) if ordered else tuple(sorted(rows, key=repr))


@functools.lru_cache(maxsize=8192)
def _gold_rows(setup: tuple[str, ...], gold: str, max_rows: int = 1000) -> tuple[tuple, ...]:
    """The gold query's normalised rows on the database of `setup` (cached: every check reruns it)."""
    result = run_sql(setup, gold, timeout_s=10.0, max_rows=max_rows)
    if result.error is not None:
        raise ValueError(f"the gold query {gold!r} failed: {result.error}")
    return tuple(tuple(_normalise(v) for v in r) for r in result.rows)


def _compare(result: SqlResult, want: Sequence[tuple], ordered: bool) -> tuple[bool, str]:
    if result.error is not None:
        return False, f"the query failed: {result.error}"
    got = [tuple(_normalise(v) for v in r) for r in result.rows]
    want = list(want)
    if got and want and len(got[0]) != len(want[0]):
        return False, f"the query returned {len(got[0])} columns per row, expected {len(want[0])}"
    if ordered:
        if got == want:
            return True, "correct"
        if Counter(got) == Counter(want):
            return False, "the right rows in the wrong order"
    elif Counter(got) == Counter(want):
        return True, "correct"
    return False, f"the query returned a different result ({len(got)} rows; the expected result has {len(want)})"


def check_sql(query: str, example: Mapping[str, Any], *, timeout_s: float = 1.0, max_rows: int = 1000) -> SqlCheck:
    """Whether `query` answers `example` (its `setup`, `test_setups`, gold `answer` and `ordered`): on
    every database (`setup`'s first, then each of `test_setups`) its rows equal the gold query's, as
    multisets, or as lists when the question asks for an order. Each query runs on a fresh copy of
    each database (the model's cannot change what the gold one sees); `timeout_s` bounds the query's
    time on all of them together. `result` and a wrong result's `message` are those of the first
    database where the query is wrong (the first one when it is right), so a model told what went
    wrong hears about the database its prompt describes first."""
    databases = [example["setup"], *example.get("test_setups", ())]
    ordered = bool(example.get("ordered"))
    deadline = time.monotonic() + timeout_s
    first = None
    for at, setup in enumerate(databases):
        try:
            want = _gold_rows(tuple(setup), example["answer"], max_rows)
        except ValueError as exc:
            raise ValueError(f"sql example {example.get('key')!r}: {exc}") from None
        remaining = timeout_s if at == 0 else max(deadline - time.monotonic(), 1e-3)
        result = run_sql(setup, query, timeout_s=remaining, max_rows=max_rows)
        if result.timed_out:  # the limit is on all databases together: report it as the caller's
            result = result._replace(error=f"timeout after {timeout_s:g} s")
        correct, message = _compare(result, want, ordered)
        first = first or result
        if not correct:
            if at > 0:
                message = (f"right on the database described, wrong on another database of the same schema "
                           f"({at + 1} of {len(databases)}): {message}")
            return SqlCheck(False, message, result)
    return SqlCheck(True, "correct", first)


_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_sql(completion: str) -> str | None:
    """The SQL in a reply: the last ```sql / ``` block (an unclosed last fence runs to the end), else
    the last <answer>...</answer>, else None. When that text holds several statements (small models
    echo the CREATE TABLE before their query), the last one that starts with SELECT or WITH is
    taken; surrounding blanks and the trailing ';' are dropped."""
    blocks = _FENCE.findall(completion) or _ANSWER.findall(completion)
    if not blocks:
        return None
    statements = _statements(blocks[-1])
    queries = [q for q in statements if re.match(r"(select|with)\b", q, re.I)]
    sql = (queries or statements or [""])[-1]
    return sql


def _statements(text: str) -> list[str]:
    """`text` split into SQL statements at the semicolons that end one (not those in a string)."""
    out, start = [], 0
    for at, char in enumerate(text):
        if char == ";" and sqlite3.complete_statement(text[start:at + 1]):
            out.append(text[start:at].strip())
            start = at + 1
    out.append(text[start:].strip())
    return [q for q in out if q]


# ---------------------------------------------------------------------------------------------
# The reward


def _sql_reward(name: str, score, *, timeout_s: float, max_rows: int, config_key: str | None):
    """A batch reward called ``config_key or name``: ``score(query, example) -> (value, timed_out)`` for
    each completion's extracted SQL; 0.0 without SQL, NaN for an example without ``setup``; queries
    stopped at the time limit counted in ``bound_hits["timeout"]`` (``reward/<name>/timeouts``)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"rewards.{config_key or name}.timeout_s must be a positive number, got {timeout_s!r}")

    def reward(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        check_batch(name, completions, examples)
        out = np.zeros(len(completions), dtype=np.float64)
        for i, (completion, example) in enumerate(zip(completions, examples)):
            if not example.get("setup"):
                out[i] = math.nan
                continue
            query = extract_sql(completion)
            if query is None:
                continue
            out[i], timed_out = score(query, example)
            if timed_out:
                reward.bound_hits["timeout"] += 1
        return out

    reward.bound_hits = Counter()
    reward.reward_name = config_key or name
    return reward


def make_sql_result_reward(*, timeout_s: float = 1.0, max_rows: int = 1000, config_key: str | None = None):
    """Reward "sql_result": 1.0 when the completion's SQL returns the gold query's result (see
    `check_sql`), else 0.0 (also for no SQL in the completion); NaN for an example without `setup`.
    Queries stopped at the time limit are counted in `bound_hits["timeout"]` (`reward/<name>/timeouts`)."""

    def score(query, example):
        check = check_sql(query, example, timeout_s=timeout_s, max_rows=max_rows)
        return float(check.correct), check.result.timed_out

    return _sql_reward("sql_result", score, timeout_s=timeout_s, max_rows=max_rows, config_key=config_key)


def make_sql_executes_reward(*, timeout_s: float = 1.0, max_rows: int = 1000, config_key: str | None = None):
    """Reward "sql_executes": 1.0 when the completion holds a query that runs on the example's
    database without error (read-only, within `timeout_s` and `max_rows`), whatever it returns; else
    0.0; NaN for an example without `setup`. A small weight beside "sql_result" gives a model that
    never gets a result right (SmolLM2-135M at the start) a signal towards valid SQL first."""

    def score(query, example):
        result = run_sql(example["setup"], query, timeout_s=timeout_s, max_rows=max_rows)
        return float(result.error is None), result.timed_out

    return _sql_reward("sql_executes", score, timeout_s=timeout_s, max_rows=max_rows, config_key=config_key)


register_task("sql", _sql_task, overwrite=True)
register_reward("sql_result", make_sql_result_reward, overwrite=True)
register_reward("sql_executes", make_sql_executes_reward, overwrite=True)

__all__ = ["QUESTION_NAMES", "TEST_SUITE_SIZE", "SqlCheck", "SqlResult", "check_sql", "extract_sql", "make_sql_executes_reward",
           "make_sql_problem", "make_sql_result_reward", "open_database", "run_sql",
           "draw_test_suite"]
