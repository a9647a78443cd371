"""``GET /api/runs/{id}/tree`` on real PostgreSQL: the whole tree of child runs a run belongs
to, from its root down through every level, in one bounded statement (a recursive CTE cut at
``TREE_MAX_NODES`` runs and ``TREE_MAX_DEPTH`` levels, the run and its ancestors always in)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from api.runs import tree_json
from api.schemas import TREE_MAX_DEPTH, TREE_MAX_NODES
from db.queries import QUERIES
from db.records import NewRun
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from tests.integration.test_child_runs import children_of, drive_tree
from tests.support import api_client


@durable_agent("tree-leaf")
def leaf(x: int, steps: Steps) -> int:
    return steps.run("double", lambda: 2 * x)


@durable_agent("tree-middle")
def middle(x: int, steps: Steps) -> int:
    return steps.child("tree-leaf", x) + steps.child("tree-leaf", x + 1)


@durable_agent("tree-top")
def top(_: Any, steps: Steps) -> int:
    return steps.child("tree-middle", 1) + steps.child("tree-leaf", 10)


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    for agent in (leaf, middle, top):
        runtime.agents.register(agent)
    return runtime


@pytest.fixture
def client(rt: Runtime, settings: Any) -> Iterator[FlaskClient]:
    with api_client(rt, settings) as c:
        yield c


def shape(tree: dict[str, Any]) -> list[tuple[int, str, str]]:
    return [(n["depth"], n["agent"], n["status"]) for n in tree["nodes"]]


def test_three_levels_from_any_run_of_the_tree(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("tree-top", {})
    drive_tree(rt, dispatch)
    assert rt.store.get_run(run.id).result == 2 + 4 + 20
    mid, leaf10 = children_of(rt, run.id)
    leaf1, leaf2 = children_of(rt, mid.id)
    expected = [
        (0, "tree-top", "SUCCEEDED"),
        (1, "tree-middle", "SUCCEEDED"),
        (2, "tree-leaf", "SUCCEEDED"),
        (2, "tree-leaf", "SUCCEEDED"),
        (1, "tree-leaf", "SUCCEEDED"),
    ]
    order = [run.id, mid.id, leaf1.id, leaf2.id, leaf10.id]
    for asked in order:  # the same tree, whichever run is asked about
        response = client.get(f"/api/runs/{asked}/tree")
        assert response.status_code == 200, response.get_data(as_text=True)
        tree = response.get_json()
        assert (tree["runId"], tree["rootId"]) == (str(asked), str(run.id))
        assert shape(tree) == expected
        assert [n["id"] for n in tree["nodes"]] == [str(i) for i in order]
        assert tree["truncated"] is False
        assert (tree["maxNodes"], tree["maxDepth"]) == (TREE_MAX_NODES, TREE_MAX_DEPTH)
    by_id = {n["id"]: n for n in tree["nodes"]}
    assert by_id[str(leaf1.id)]["parentRunId"] == str(mid.id)
    assert by_id[str(run.id)]["parentRunId"] is None
    assert [by_id[str(i)]["childCount"] for i in order] == [2, 2, 0, 0, 0]
    # tokens and cost as GET /api/runs/{id} reports them
    for n in tree["nodes"]:
        one = client.get(f"/api/runs/{n['id']}").get_json()
        assert (n["tokensUsed"], n["costUsd"], n["status"]) == (
            one["tokensUsed"],
            one["costUsd"],
            one["status"],
        )


def test_a_run_without_children_is_a_tree_of_one(rt: Runtime, client: FlaskClient) -> None:
    run, _ = rt.submit("tree-leaf", 1)
    tree = client.get(f"/api/runs/{run.id}/tree").get_json()
    assert shape(tree) == [(0, "tree-leaf", "QUEUED")]
    assert tree["truncated"] is False


def test_another_tenants_run_and_a_bad_id_are_404(rt: Runtime, client: FlaskClient) -> None:
    assert client.get(f"/api/runs/{uuid.uuid4()}/tree").status_code == 404
    assert client.get("/api/runs/not-a-uuid/tree").status_code == 404
    run, _ = rt.submit("tree-leaf", 1)
    # the store answers nothing for another tenant (the API's load_run checks it first)
    assert rt.store.run_tree(run.id, "other", max_nodes=5, max_depth=5) == []


WALK_INDEX = "run_parent_created_idx"


def _add(rt: Runtime, parent: uuid.UUID | None, agent: str = "tree-leaf") -> uuid.UUID:
    run, _ = rt.store.create_run(NewRun(agent, 1, "m", 10, 1000, 60, parent_run_id=parent))
    return run.id


def _add_many(rt: Runtime, parent: uuid.UUID, n: int) -> None:
    """``n`` children of ``parent`` in one statement, started 1 ms apart from now."""
    with rt.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO run (id, agent, input, model, max_steps, token_budget, "
                "timeout_seconds, deadline_at, parent_run_id, tenant, dispatch_token, "
                "created_at) "
                "SELECT gen_random_uuid(), 'tree-leaf', '1', 'm', 10, 1000, 60, "
                "now() + interval '1 hour', :parent, '', gen_random_uuid(), "
                "clock_timestamp() + g * interval '1 ms' FROM generate_series(1, :n) g"
            ),
            {"parent": parent, "n": n},
        )


def test_a_huge_tree_is_cut_breadth_first_and_keeps_the_asked_run(
    rt: Runtime, client: FlaskClient
) -> None:
    root = _add(rt, None, "tree-top")
    first = _add(rt, root, "tree-middle")  # oldest child: its subtree comes first in order
    _add_many(rt, root, TREE_MAX_NODES + 50)
    deep = _add(rt, first)  # a grandchild: past the cap in breadth-first order
    tree = client.get(f"/api/runs/{root}/tree").get_json()
    assert tree["truncated"] is True
    assert len(tree["nodes"]) == TREE_MAX_NODES
    head = tree["nodes"][0]
    assert (head["id"], head["childCount"]) == (str(root), TREE_MAX_NODES + 1)
    assert str(deep) not in {n["id"] for n in tree["nodes"]}, "cut: the deepest level first"
    # Asked from the grandchild, it is shown all the same, under its parent, with the path.
    tree = client.get(f"/api/runs/{deep}/tree").get_json()
    ids = [n["id"] for n in tree["nodes"]]
    assert ids[:3] == [str(root), str(first), str(deep)]
    assert len(ids) == TREE_MAX_NODES + 1
    assert tree["nodes"][2]["depth"] == 2


def test_a_chain_deeper_than_the_cap_is_cut_at_max_depth(rt: Runtime, client: FlaskClient) -> None:
    chain = [_add(rt, None, "tree-top")]
    for _ in range(TREE_MAX_DEPTH + 3):
        chain.append(_add(rt, chain[-1]))
    from_top = client.get(f"/api/runs/{chain[0]}/tree").get_json()
    assert [n["id"] for n in from_top["nodes"]] == [str(i) for i in chain[: TREE_MAX_DEPTH + 1]]
    assert from_top["nodes"][-1]["childCount"] == 1, "says there is more below"
    assert from_top["truncated"] is True
    from_bottom = client.get(f"/api/runs/{chain[-1]}/tree").get_json()
    assert from_bottom["rootId"] == str(chain[-1 - TREE_MAX_DEPTH])
    assert from_bottom["nodes"][0]["parentRunId"] == str(chain[-2 - TREE_MAX_DEPTH])
    assert from_bottom["nodes"][-1]["id"] == str(chain[-1])
    assert from_bottom["truncated"] is True


def test_the_statement_reads_a_bounded_number_of_rows(rt: Runtime) -> None:
    """A root with ten times the cap in children, ten of them with a hundred children each:
    the walk reads the cap's worth of the root's children in order from
    run_parent_created_idx and stops there (PostgreSQL evaluates the recursive CTE only as far
    as the LIMIT reads); it neither reads nor sorts them all, nor goes down a level."""
    root = _add(rt, None, "tree-top")
    _add_many(rt, root, 2000)
    with rt.engine.connect() as conn:
        first = conn.execute(
            text("SELECT id FROM run WHERE parent_run_id = :r ORDER BY created_at LIMIT 10"),
            {"r": root},
        ).scalars()
        for kid in list(first):
            _add_many(rt, kid, 100)
    with rt.engine.begin() as conn:
        conn.execute(text("ANALYZE run"))
    params = {"id": root, "tenant": "", "max_nodes": TREE_MAX_NODES, "max_depth": TREE_MAX_DEPTH}
    sql = QUERIES["run_tree"].text
    with rt.engine.begin() as conn:  # as RunStore.run_tree runs it
        conn.execute(QUERIES["run_tree_plan"])
        plan = conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}"), params).scalar_one()
    plan = plan if isinstance(plan, list) else json.loads(plan)
    read: list[tuple[str, str, int]] = []  # node type, index, rows (all loops)
    sorted_run_rows: list[dict[str, Any]] = []

    def reads_run(node: dict[str, Any]) -> bool:
        return node.get("Relation Name") == "run" or any(map(reads_run, node.get("Plans", [])))

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "run":
            # rows per loop, averaged and rounded by EXPLAIN: within one row a loop
            rows = int(node["Actual Rows"]) * int(node["Actual Loops"])
            read.append((node["Node Type"], node.get("Index Name", ""), rows))
        if node["Node Type"] == "Sort" and reads_run(node):
            sorted_run_rows.append(node)
        for sub in node.get("Plans", []):
            walk(sub)

    walk(plan[0]["Plan"])
    assert {kind for kind, _, _ in read} <= {"Index Scan", "Index Only Scan"}, read
    # the walk: 200 of the root's 2,000 children, in order, and no level further down
    walked = [n for kind, index, n in read if (kind, index) == ("Index Scan", WALK_INDEX)]
    assert walked == [TREE_MAX_NODES], read
    assert sorted_run_rows == [], "children come in order from the index, never sorted"
    # the children counted, up to 201 a run (201 runs): the root's 201, the ten's 100 each
    [counted] = [n for kind, _, n in read if kind == "Index Only Scan"]
    assert counted <= TREE_MAX_NODES + 1 + 10 * 100 + (TREE_MAX_NODES + 1), read
    rows = rt.store.run_tree(root, "", max_nodes=TREE_MAX_NODES, max_depth=TREE_MAX_DEPTH)
    tree = tree_json(root, rows)
    assert len(tree["nodes"]) == TREE_MAX_NODES
    assert tree["truncated"]
