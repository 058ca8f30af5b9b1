"""Reports: the STATS summary and the prefill simulator's report (targets, grid, plots)."""
