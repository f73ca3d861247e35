"""`tokenmill.generate` on DataFrames, Arrow tables and lists, with the real engine."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pytest

import tokenmill
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.notebook import generate, to_arrow

ENGINE = {"kv_cache_memory": 8 << 20}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return llm_cache.get_llm(str(tiny_model_dir), dtype="float32", **ENGINE).llm


def test_polars_in_input_order_with_bad_rows(llm):
    df = pl.DataFrame(
        {
            "q": ["The quick brown fox " * 3 + "jumps", None, "Numbers: 1 2", "", "x"],
            "lang": ["en", "en", "fr", "de", "it"],
        }
    )
    res = generate(df, prompt_column="q", llm=llm, max_tokens=3)
    assert isinstance(res, pl.DataFrame)
    assert res["id"].to_list() == [f"row-{i:09d}" for i in range(5)]
    assert res["lang"].to_list() == df["lang"].to_list()  # input order, passthrough kept
    assert res["q"].to_list() == df["q"].to_list()
    assert res["error"].to_list()[1:4:2] == ["prompt is null", "prompt is empty"]
    ok = res.filter(pl.col("error").is_null())
    assert ok.height == 3 and ok["completion_tokens"].to_list() == [3, 3, 3]


def test_same_answers_whatever_the_submission_order(llm):
    prompts = ["Numbers: 1 2 3", "The quick brown fox", "Numbers: 1 2 3 4", "def add(a, b):"]
    forward = generate(prompts, llm=llm, max_tokens=4)
    backward = generate(prompts[::-1], llm=llm, max_tokens=4)
    assert forward["output"].to_list() == backward["output"].to_list()[::-1]
    assert forward["prompt"].to_list() == prompts


def test_arrow_template_and_chat(llm):
    table = pa.table({"text": ["one", "two"], "k": [10, 11]})
    res = generate(
        table,
        template="Summarise: {text}",
        system="Be brief.",
        id_column="k",
        llm=llm,
        max_tokens=2,
        passthrough=[],
    )
    assert res.columns == [
        "id",
        "output",
        "finish_reason",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "error",
    ]
    assert res["id"].to_list() == ["10", "11"]
    # ChatML: system + user turns and the assistant header around the short text
    assert res["prompt_tokens"][0] > len("Summarise: one") // 2


def test_the_shared_engine_is_used_and_kept(tiny_model_dir):
    shared = llm_cache.get_llm(str(tiny_model_dir), dtype="float32", **ENGINE)
    loads = llm_cache.num_loads()
    res = generate(
        ["hello"], model=str(tiny_model_dir), dtype="float32", engine_options=ENGINE, max_tokens=1
    )
    assert res["completion_tokens"].to_list() == [1]
    assert llm_cache.num_loads() == loads  # the notebook call reused the loaded engine
    assert llm_cache.get_llm(str(tiny_model_dir), dtype="float32", **ENGINE) is shared


def test_public_export_and_errors(llm):
    assert tokenmill.generate is generate
    with pytest.raises(ValueError, match=r"data: missing column\(s\) 'prompt'"):
        generate(pl.DataFrame({"x": ["a"]}), llm=llm)
    with pytest.raises(TypeError, match="polars or pandas"):
        to_arrow({"prompt": ["a"]})
    with pytest.raises(ValueError, match="duplicate"):
        generate(pl.DataFrame({"prompt": ["a", "b"], "i": [1, 1]}), id_column="i", llm=llm)


def test_pandas_input(llm):
    pd = pytest.importorskip("pandas")
    res = generate(pd.DataFrame({"prompt": ["hi", "yo"]}), llm=llm, max_tokens=1)
    assert res.height == 2 and res["error"].null_count() == 2


def test_lazyframe(llm):
    res = generate(pl.LazyFrame({"prompt": ["hi"]}), llm=llm, max_tokens=1)
    assert res.height == 1


def test_kv_cache_dtype_reaches_the_engine_and_a_model_that_cannot_have_it_fails_first(
    tiny_model_dir,
):
    """The job option goes to LLM(kv_cache_dtype=...): the tiny model's 16-value heads
    cannot be cut into int8 groups of 32, which is said before any row is computed."""
    with pytest.raises(ValueError, match="head_dim to be a multiple of 32; this model's is 16"):
        generate(
            ["one", "two"],
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_dtype="int8",
            engine_options=ENGINE,
            max_tokens=2,
        )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        generate(["one"], model=str(tiny_model_dir), kv_cache_dtype="fp8", max_tokens=2)
