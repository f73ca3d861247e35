"""A batch of a reasoning model: the Batch object's usage counts the reasoning tokens its
output lines report (`output_tokens_details.reasoning_tokens`), and a database made
before that column existed gains it, its batches counting 0."""

from __future__ import annotations

from api_helpers import ApiServer, batch_lines, content_lines, submit, wait_for
from sqlalchemy import text
from tiny_model import build_tiny_model

from tokenmill.batch_api.database import Database

THINK_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# <think></think> #}"
THINK_ANSWER = "<think>two plus two</think>four"


def test_the_batch_usage_counts_its_lines_reasoning_tokens(tmp_path):
    model = build_tiny_model(tmp_path / "model", chat_template=THINK_TEMPLATE)
    # A choice constraint fixes the answer, so every line reasons the same way.
    budget = len(THINK_ANSWER) + 2
    options = {"max_tokens": budget, "choice": [THINK_ANSWER]}
    server = ApiServer(tmp_path / "store", model, job_options=options)
    with server.client() as client:
        batch = wait_for(
            client, "alice", submit(client, "alice", batch_lines(3, max_tokens=budget))["id"]
        )
        output = content_lines(client, "alice", batch["output_file_id"])
    assert batch["status"] == "completed", batch["errors"]
    usages = [o["response"]["body"]["usage"] for o in output]
    per_line = [u["completion_tokens_details"]["reasoning_tokens"] for u in usages]
    assert len(set(per_line)) == 1 and per_line[0] > 0
    assert all(
        u["completion_tokens"] > u["completion_tokens_details"]["reasoning_tokens"] for u in usages
    )
    usage = batch["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == sum(per_line)
    assert usage["output_tokens"] == sum(u["completion_tokens"] for u in usages)


def test_a_database_from_before_reasoning_tokens_gains_the_column(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    db = Database(url)
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE batches DROP COLUMN reasoning_tokens"))
        conn.execute(
            text(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window,"
                " status, num_lines, created_at, total, completed, failed, input_tokens,"
                " cached_tokens, output_tokens, work_removed)"
                " VALUES ('batch_old', 'o', '/v1/chat/completions', 'file_x', '24h',"
                " 'completed', 1, 0, 1, 1, 0, 5, 0, 3, 0)"
            )
        )
    db.close()
    db = Database(url)
    try:
        old = db.batch_by_id("batch_old")
        assert (old["output_tokens"], old["reasoning_tokens"]) == (3, 0)
        db.update_batch("batch_old", reasoning_tokens=2)
        assert db.batch_by_id("batch_old")["reasoning_tokens"] == 2
    finally:
        db.close()
