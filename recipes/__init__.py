"""Recipes: training configs, launch configs and the scripts that run them (a package only so that
`python -m recipes.scoring.summary` runs from the repository root)."""
