"""SQL tasks: a fresh database per question, the model's SQL read-only and time-limited, the result
set compared with the gold query's; the "sql" task and the "sql_result" reward."""

import math
import os

import pytest

import rljax.environments  # noqa: F401 - registers the "sql" task and the "sql_result" reward
from rljax.data import make_task
from rljax.environments.sql_tasks import QUESTION_NAMES, check_sql, extract_sql, open_database, run_sql
from rljax.rewards import build_rewards, registered_rewards
from rljax.rewards.bounded import bound_hit_metrics

SETUP = [
    "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT, salary INTEGER, age INTEGER)",
    "INSERT INTO employees VALUES (1, 'Ada', 'Sales', 50000, 30)",
    "INSERT INTO employees VALUES (2, 'Ben', 'Sales', 70000, 40)",
    "INSERT INTO employees VALUES (3, 'Cleo', 'Legal', 90000, 50)",
]
BY_NAME = {"setup": SETUP, "answer": "SELECT name FROM employees WHERE salary > 60000 ORDER BY name", "ordered": True}
AVERAGES = {"setup": SETUP, "answer": "SELECT department, AVG(salary) FROM employees GROUP BY department",
            "ordered": False}
RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"


def test_questions_are_deterministic_split_by_question_and_their_gold_queries_run():
    train = make_task("sql", split="train", size=30, seed=1)
    evals = make_task("sql", split="eval", size=30, seed=1)
    assert train == make_task("sql", split="train", size=30, seed=1)
    assert not {e["key"] for e in train} & {e["key"] for e in evals}
    assert {e["template"] for e in train + evals} == set(QUESTION_NAMES)  # 60 draws reach all 10 questions
    for example in train:
        assert example["prompt"].startswith("SQLite database:\nCREATE TABLE")
        assert check_sql(example["answer"], example).correct


def test_results_compare_as_sets_unless_an_order_is_asked():
    assert check_sql("SELECT name FROM employees WHERE salary >= 70000 ORDER BY name", BY_NAME).correct
    wrong_order = check_sql("SELECT name FROM employees WHERE salary > 60000 ORDER BY name DESC", BY_NAME)
    assert not wrong_order.correct and wrong_order.message == "the right rows in the wrong order"
    assert wrong_order.result.rows == [("Cleo",), ("Ben",)]
    # Unordered: any row order; 60000.0 (AVG) equals 60000 (an integer expression).
    check = check_sql("SELECT department, SUM(salary) / COUNT(*) FROM employees GROUP BY department "
                      "ORDER BY department DESC", AVERAGES)
    assert check.correct and check.message == "correct"
    columns = check_sql("SELECT department FROM employees GROUP BY department", AVERAGES)
    assert columns.message == "the query returned 1 columns per row, expected 2"
    fewer = check_sql("SELECT name FROM employees WHERE salary > 80000", BY_NAME)
    assert fewer.message == "the query returned a different result (1 rows; the expected result has 2)"


@pytest.mark.parametrize("query", [
    "DELETE FROM employees", "UPDATE employees SET salary = 0", "INSERT INTO employees VALUES (4, 'X', 'Y', 1, 1)",
    "DROP TABLE employees", "CREATE TABLE t (x)", "ATTACH DATABASE '/tmp/rljax-sql-escape.db' AS x",
    "PRAGMA query_only = OFF", "BEGIN",
])
def test_writes_and_side_doors_are_refused(query):
    conn = open_database(SETUP)
    result = run_sql(conn, query)
    assert result.rows is None and "not authorized" in result.error
    assert conn.execute("SELECT COUNT(*), SUM(salary) FROM employees").fetchall() == [(3, 210000)]
    assert not check_sql(query, BY_NAME).correct
    assert not os.path.exists("/tmp/rljax-sql-escape.db")


def test_bad_sql_several_statements_and_runaway_queries_fail_cleanly():
    assert run_sql(SETUP, "SELEC name FROM employees").error == 'OperationalError: near "SELEC": syntax error'
    assert run_sql(SETUP, "SELECT salry FROM employees").error == "OperationalError: no such column: salry"
    assert "one statement at a time" in run_sql(SETUP, "SELECT 1; DELETE FROM employees").error
    runaway = run_sql(SETUP, RUNAWAY, timeout_s=0.3)
    assert runaway.timed_out and runaway.error == "timeout after 0.3 s"
    endless = run_sql(SETUP, RUNAWAY.replace("COUNT(*)", "x"), max_rows=50)
    assert endless.error == "more than 50 rows"
    assert run_sql(SETUP, "SELECT zeroblob(2000000000)").error == "DataError: string or blob too big"
    assert run_sql(SETUP, "SELECT COUNT(*) FROM employees").rows == [(3,)]  # and it goes on


@pytest.mark.parametrize("reply, sql", [
    ("```sql\nSELECT 1;\n```", "SELECT 1"),
    ("first ```sql\nSELECT 1\n``` then ```\nSELECT 2\n```", "SELECT 2"),
    ("```sql\nSELECT name FROM t", "SELECT name FROM t"),
    ("<answer>SELECT 3</answer>", "SELECT 3"),
    ("SELECT 4", None),
    ("```sql\nCREATE TABLE t (x TEXT);\nSELECT x FROM t WHERE x = 'a;b';\nDELETE FROM t;\n```",
     "SELECT x FROM t WHERE x = 'a;b'"),  # the last query of several; a ';' inside a string stays
    ("```sql\nDROP TABLE t;\n```", "DROP TABLE t"),
])
def test_extract_sql(reply, sql):
    assert extract_sql(reply) == sql


def test_sql_result_reward_scores_a_batch():
    assert "sql_result" in registered_rewards()
    rewards = build_rewards({"sql": {"type": "sql_result", "timeout_s": 0.3}})
    completions = ["```sql\nSELECT name FROM employees WHERE salary > 60000 ORDER BY name;\n```",
                   "```sql\nSELECT name FROM employees\n```", "Ben and Cleo.", f"```sql\n{RUNAWAY}\n```",
                   "```sql\nSELECT 1\n```"]
    values = rewards(completions, [BY_NAME] * 4 + [{"prompt": "no database"}]).per_function["sql"]
    assert values[:4].tolist() == [1.0, 0.0, 0.0, 0.0] and math.isnan(values[4])
    assert bound_hit_metrics(rewards.functions)["reward/sql/timeouts"] == 1.0
    runs = build_rewards({"runs": {"type": "sql_executes", "timeout_s": 0.3}})
    ran = runs(completions, [BY_NAME] * 4 + [{"prompt": "no database"}]).per_function["runs"]
    assert ran[:4].tolist() == [1.0, 1.0, 0.0, 0.0] and math.isnan(ran[4])  # wrong but valid SQL runs
    with pytest.raises(ValueError, match="rewards.sql.timeout_s must be a positive number"):
        build_rewards({"sql": {"type": "sql_result", "timeout_s": 0}})
