"""The router's durable state: small named records (the update journal, the fleet's weights,
the weight-update groups), kept in memory as the truth and copied to a store.

:mod:`.store` says where records live (a directory by default); :mod:`.durable`
keeps each record's copy in step with memory, retrying a store that refused a
write until it takes one, and reports the fault meanwhile.
"""
