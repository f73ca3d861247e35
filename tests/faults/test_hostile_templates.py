"""A model directory's chat template is untrusted code: escapes, file reads, endless loops
and memory bombs are refused or stopped, with a clear error, in bounded time and memory;
in a job each such row becomes an error row and the job completes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import jinja2
import pytest
from store_fixtures import _isolated_cache  # noqa: F401 - fixture
from tiny_model import build_tiny_model

from tokenmill.engine.loader.chat_sandbox import MAX_RENDER_SECONDS, ChatTemplateLimit
from tokenmill.engine.loader.tokenizer import Tokenizer, compile_chat_template
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

USER = [{"role": "user", "content": "hi"}]
ESCAPES = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "globals": "{{ cycler.__init__.__globals__ }}",
    "namespace": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
}
FILE_READS = {
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import '/etc/passwd' as x %}{{ x }}",
    "extends": "{% extends '/etc/passwd' %}",
}
# Each would take gigabytes (or hours) without the limits in engine/loader/chat_sandbox.py.
BOMBS = {
    "range": "{% for i in range(10**9) %}x{% endfor %}",
    "repeat": "{{ 'x' * 10**10 }}",
    "center": "{{ ''|center(10**10) }}",
    "ljust": "{{ ''.ljust(10**10) }}",
    "percent": "{{ '%0999999999d' % 1 }}",
    "format": "{{ '{:>999999999}'.format(1) }}",
    "format_filter": "{{ '%999999999s'|format('') }}",
    "replace": "{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}",
    "power": "{{ 2 ** (10 ** 10) }}",
    "output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def render(source: str, messages=USER) -> str:
    tokenizer = Tokenizer.__new__(Tokenizer)  # only the template is exercised here
    tokenizer.chat_template = source
    tokenizer.special_tokens = {}
    return tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_sandbox_escapes_are_refused(name):
    with pytest.raises(jinja2.exceptions.SecurityError, match="unsafe|may not set attribute"):
        render(ESCAPES[name])


@pytest.mark.parametrize("name", sorted(FILE_READS))
def test_templates_cannot_read_files(name):
    with pytest.raises(TypeError, match="no loader"):
        render(FILE_READS[name])


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_memory_bombs_are_refused_before_they_allocate(name):
    start = time.monotonic()
    with pytest.raises((ChatTemplateLimit, OverflowError)) as info:
        render(BOMBS[name])
    assert time.monotonic() - start < 2.0
    assert "chat template" in str(info.value) or "MAX_RANGE" in str(info.value)


def test_an_endless_loop_is_stopped_at_the_deadline():
    tracer = sys.gettrace()  # e.g. a coverage tool's: it must be back afterwards
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimit, match=r"rendering took over 5 s \(stopped\)"):
        render(ENDLESS)
    assert MAX_RENDER_SECONDS <= time.monotonic() - start < MAX_RENDER_SECONDS + 2.0
    assert sys.gettrace() is tracer
    assert render("{{ messages[0].content }}") == "hi"  # the next render is unaffected


def test_real_templates_are_untouched():
    # A long message and a loop over messages render exactly as jinja2 would.
    content = "word " * 200_000  # 1 MB of text: well within the limits
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    source = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    expected = compile_chat_template(source).render(messages=messages, add_generation_prompt=True)
    assert render(source, messages) == expected


def test_peak_memory_of_all_bombs_stays_small():
    # A fresh process, so ru_maxrss measures the renders and not the rest of the suite.
    script = textwrap.dedent(
        f"""
        import json, resource
        from tokenmill.engine.loader.tokenizer import compile_chat_template
        from tokenmill.engine.loader.chat_sandbox import render_limited
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        refused = 0
        for source in {list(BOMBS.values())!r}:
            try:
                render_limited(compile_chat_template(source), {{"messages": []}})
            except Exception:
                refused += 1
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"refused": refused, "kib": after - before}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["refused"] == len(BOMBS)
    # The "output" bomb builds up to the 64 Mi-character cap before it is refused.
    assert measured["kib"] < 400 * 1024, measured


def test_a_hostile_model_dir_makes_error_rows_and_the_job_completes(tmp_path):
    template = ESCAPES["globals"] + FILE_READS["include"]
    model = build_tiny_model(tmp_path / "hostile", chat_template=template)
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"h{i}", "prompt": f"p {i}"}) + "\n" for i in range(5))
    )
    out = tmp_path / "out"

    ledger = run_job(
        str(src),
        str(out),
        model=str(model),
        id_column="id",
        max_tokens=2,
        dtype="float32",
        engine_options={"kv_cache_memory": 8 << 20},
    )

    results = read_results(str(out))
    assert sorted(results["id"].to_pylist()) == [f"h{i}" for i in range(5)]
    assert (ledger.rows_ok, ledger.rows_failed) == (0, 5)
    assert set(results["error"].to_pylist()) == {
        "chat template failed: SecurityError: access to attribute '__init__' of 'type' "
        "object is unsafe."
    }
    # Nothing outside the output directory was created by the job.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile", "in.jsonl", "out"]
