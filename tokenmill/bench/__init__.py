"""The side-by-side benchmark: seeded workloads, per-system runs in separate processes,
and a report of throughput, latency, memory and roofline fraction as ratios."""
