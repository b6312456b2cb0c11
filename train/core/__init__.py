"""What every command shares and nothing else needs to know: the one error style and exit codes, atomic
files, safe (never unpickling) loads, strict YAML, installed presets (and `distaff presets`), CPU threads per
process, how much library output to show (`--verbose`), progress lines, rank variables, the output-folder lock and the stalled-rank watchdog.

Imports: nothing of distaff (the bottom layer). Imported by: every other package of ``distaff.train`` and
by ``distaff.launch``.
"""
