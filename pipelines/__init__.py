"""Datasets in, results and a token-cost ledger out: everything between connectors and engine.

templating  row -> prompt text or chat messages (bad row -> error record)
tokenize    batch-encode; over-long prompts -> error rows
plan        order by shared prefix and length; cut each window into content-addressed shards
results     the results schema; a shard's table from engine outputs
logprobs    generated tokens' logprobs as a results column (token, bytes, top alternatives)
pricing     prices and exact cost arithmetic
ledger      the per-job ledger, computed from the result rows
options     the job definition: every option, declared once; every surface derived
spec        JobSpec: a job's options, validated before any work
reading     input batches -> windows of prompt rows; job-level id checks
ids         null/duplicate ids over a stream, in 8 bytes a row
spill       a shard's planned rows as a table (the plan files under OUTPUT/_plan/)
output      the output directory layout and its atomic reads/writes
planning    plan_job: read, template, tokenize, shard - before any model is loaded
running     prepare_output / run_shard: generate one shard, publish its part
finalizing  finalize_job: check the parts, write the ledger
job         run_job: the three stages composed
notebook    generate(): DataFrame in, DataFrame out, in input order
"""
