ALTER TABLE "{table}" DROP COLUMN hold;
