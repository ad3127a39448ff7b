"""The lake: object stores behind one small port (:mod:`runtime.lake.store`) and Delta Lake
commits through delta-rs (:mod:`runtime.lake.delta`)."""
