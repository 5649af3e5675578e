"""The benchmark behind ``ubatch-bench`` (``ubatch.bench.cli``): unsplit vs ubatched steps of the
reference models with the ideal beside them (``measure``, ``graphs``, ``sweep``), the split
policy's picks (``auto``, ``calibration``, ``replay``), whole generations (``generation``), and
the report's table, notes and plots (``report``, ``plot``)."""
