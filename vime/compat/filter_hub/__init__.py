"""`vime.rollout.filter_hub` (and `slime.rollout.filter_hub`): slime's dynamic-sampling filters and
their types, as filters and rollout functions written for slime import them; vime's filters
(vime/rollout/filters.py) are the same rules."""
