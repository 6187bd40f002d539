"""Operating an instance: `ecshare doctor` (is this machine and config ready?) and
`ecshare status` (what is a running producer doing?).

May import: anything in ecshare.
"""
