-- What payouts.sql and batches.sql share: the probe of this backend's CPU, included first.
-- This backend's user + system time in ms (utime and stime of /proc/<pid>/stat, in clock ticks).
CREATE FUNCTION probe_cpu_ms() RETURNS numeric LANGUAGE sql AS $$
    SELECT (split_part(s, ' ', 12)::bigint + split_part(s, ' ', 13)::bigint)
           * 1000.0 / current_setting('probe.ticks')::numeric
      FROM (SELECT split_part(pg_read_file('/proc/' || pg_backend_pid() || '/stat'), ') ', 2)) x(s)
$$;
SET probe.ticks = :ticks;
