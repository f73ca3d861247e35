"""Datasets in, results and a token-cost ledger out: everything between connectors and engine.

images      image cells -> encoded bytes under the job's roots and URL schemes (bad -> error)
image_fetch an http(s) image from the address its host was checked at; no redirects
templating  row -> prompt text or chat messages (bad row -> error record)
tokenize    batch-encode; over-long prompts -> error rows
plan        order by shared prefix and length; cut each window into content-addressed shards
prefix_cut  where the cuts fall: filled shards, or between rows sharing the least prefix
balance_cut shards of equal work for engines that run at once: the run order dealt out
dedupe      identical deterministic rows computed once; copy shards give copies the answer
dedupe_buckets  the same copies found in hash buckets on workers, a window's read back
results     the results schema; a shard's table from engine outputs
logprobs    generated tokens' logprobs as a results column (token, bytes, top alternatives)
pricing     prices and exact cost arithmetic
report      figures as people read them ("not set", "no prices set", $0.0123)
ledger      the per-job ledger, computed from the result rows
options     the job definition: every option, declared once; every surface derived
spec        JobSpec: a job's options, validated before any work
reading     input batches -> windows of prompt rows; job-level id checks
ids         null/duplicate ids over a stream, in 8 bytes a row
id_buckets  null/duplicate ids over parts read apart: hash buckets, one task each
spill       a shard's planned rows as a table (the plan files under OUTPUT/_plan/)
output      the output directory layout and its atomic reads/writes
planning    plan_job: read, template, tokenize, shard - before any model is loaded
spread_planning  plan_job with reading, tokenizing and id checks as tasks over the input's
                 partitions on a cluster's workers
calibration a short timed run of a sample: completion lengths and step costs
forecast    the bill before the job runs: exact tokens, bounds, estimates (LLM.plan)
progress    a run's progress per engine step: tokens, rate, ETA, cost so far
running     prepare_output / run_shard: generate one shard, publish its part
dry_run     forecast a planned job, record it, keep nothing else
finalizing  finalize_job: check the parts, write the ledger
job         run_job: the three stages composed (or the dry run)
notebook    generate(), forecast(): DataFrame in, DataFrame out, in input order
"""
