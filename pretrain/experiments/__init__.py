"""The study: its grid of variants x seeds and each cell's row (grid), the runner of its jobs
(runner), paired statistics and verdicts (stats), how far learned weights moved (movement), the report (report)
and matplotlib figures (figures). Imports: every package below; never a command."""
