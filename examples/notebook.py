# %% [markdown]
# # tokenmill in a notebook
#
# `tokenmill.generate` answers every row of a DataFrame and returns the results in
# input order, next to the original columns. The model (by default SmolLM2-135M-Instruct,
# converted from its GGUF on first use) is loaded once per process and reused by later
# calls. Run the cells in VS Code / Jupyter (`# %%` cells), or the whole file:
# `python examples/notebook.py`.

# %%
import polars as pl

import tokenmill

reviews = pl.DataFrame(
    {
        "product": ["kettle", "headphones", "backpack", "desk lamp", "running shoes"],
        "review": [
            "Boils water fast and the handle stays cool. Love it.",
            "Sound is fine but the left ear stopped working after a week.",
            "Plenty of pockets, comfortable straps, survived a rainy hike.",
            "Too dim to read by and the switch feels cheap.",
            "Light and comfortable, though they run half a size small.",
        ],
    }
)

# %% [markdown]
# A template over columns, sent as a user message through the model's chat template
# after the shared system prompt. Sampling options are keyword arguments (greedy by
# default).

# %%
labelled = tokenmill.generate(
    reviews,
    template="Product: {product}\nReview: {review}\nIs this review positive or negative?",
    system="You label customer reviews. Answer with one word: positive or negative.",
    max_tokens=4,
)
labelled.select("product", "output", "finish_reason", "prompt_tokens", "cached_tokens")

# %% [markdown]
# A plain list of prompts works too; bad rows come back as error rows rather than
# exceptions, so the good rows are never lost. Prompts go through the chat template
# here as well (`raw=True` would send them as they are).

# %%
answers = tokenmill.generate(
    ["What is the capital of Italy?", "", "Name a primary colour."],
    max_tokens=24,
)
answers.select("prompt", "output", "error")

# %% [markdown]
# Token counts per row make cost questions one expression away.

# %%
labelled.select(
    pl.col("prompt_tokens").sum().alias("prompt_tokens"),
    pl.col("cached_tokens").sum().alias("cached_tokens"),
    pl.col("completion_tokens").sum().alias("completion_tokens"),
)

# %%
if __name__ == "__main__":
    with pl.Config(fmt_str_lengths=80, tbl_width_chars=160):
        print(labelled.select("product", "output", "prompt_tokens", "cached_tokens"))
        print(answers.select("prompt", "output", "error"))
