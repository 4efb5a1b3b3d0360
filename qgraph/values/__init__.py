"""Values: the catalogue of a program's standard values (``catalogue``), names and globs
(``names``), values computed after a run (``derive``) and the support table (``support``)."""
