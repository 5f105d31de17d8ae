-- Why a pending record is set aside, so that claims never read it: NULL
-- when it is not (claims walk it), 'retry' while it waits for its own
-- due_at, 'behind' while an earlier record of its key is pending (or dead
-- and holding the key). On a dead record, 'key' when it holds back the
-- later records of its key (dead-lettered with HoldOnDeadLetter).
ALTER TABLE "{table}" ADD COLUMN hold TEXT;
