"""Application-level benchmarks (``hpctrain bench ...``): each prints ratios against a
baseline measured in the same run, and writes its rows as JSON on request."""
