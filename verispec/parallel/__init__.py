"""Running across devices and processes: tensor parallelism for the target (:mod:`verispec.parallel.tp`)."""
