package console

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/internal/safetext"
)

// safeLogger is the console's logger: it escapes the control characters of
// every text field and error it passes on (safetext.Escape), so that
// nothing a producer stored (a key, a topic, an error) or a request sent (a
// reason, a path, the actor's name) can break a log line or start a line
// of its own, whichever logger the application gives.
type safeLogger struct{ watermill.LoggerAdapter }

func (l safeLogger) Error(msg string, err error, fields watermill.LogFields) {
	if err != nil {
		err = escapedError{err}
	}
	l.LoggerAdapter.Error(msg, err, escapeFields(fields))
}

func (l safeLogger) Info(msg string, fields watermill.LogFields) {
	l.LoggerAdapter.Info(msg, escapeFields(fields))
}

func (l safeLogger) Debug(msg string, fields watermill.LogFields) {
	l.LoggerAdapter.Debug(msg, escapeFields(fields))
}

func (l safeLogger) Trace(msg string, fields watermill.LogFields) {
	l.LoggerAdapter.Trace(msg, escapeFields(fields))
}

func (l safeLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return safeLogger{l.LoggerAdapter.With(escapeFields(fields))}
}

func escapeFields(fields watermill.LogFields) watermill.LogFields {
	if fields == nil {
		return nil
	}
	out := make(watermill.LogFields, len(fields))
	for k, v := range fields {
		switch v := v.(type) {
		case string:
			out[safetext.Escape(k)] = safetext.Escape(v)
		case error:
			out[safetext.Escape(k)] = escapedError{v}
		default:
			out[safetext.Escape(k)] = v
		}
	}
	return out
}

// escapedError is an error whose text is escaped; errors.Is and errors.As
// still see the error it wraps.
type escapedError struct{ err error }

func (e escapedError) Error() string { return safetext.Escape(e.err.Error()) }
func (e escapedError) Unwrap() error { return e.err }
