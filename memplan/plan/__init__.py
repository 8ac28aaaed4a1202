"""Plans: one plan's estimate (estimate), the search over t / p / d / cp / ep / micro-batch / interleaving / SP /
recompute / ZeRO (space, evaluate, fit, search; arrange: ranking and folding), and the longest sequence or
micro-batch that fits (limits)."""
