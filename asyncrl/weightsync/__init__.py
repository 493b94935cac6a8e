"""Learner -> engine weight pushes: versioned, verified before commit, atomic, resharded into the engines' layout.
The modules and what each owns: docs/design/weightsync.md."""
