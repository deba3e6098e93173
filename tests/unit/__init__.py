"""Tests of one component each, in a folder per package of vime/ (tests/unit/engine/ for
vime/engine/, ...; a module of vime/ itself beside this file). Packages, so that two test files
of one name in different folders never clash, and a helper module is imported by its path
(`from unit.trainer.actors import make_args`): tests/ is on sys.path (tests/conftest.py's folder)."""
