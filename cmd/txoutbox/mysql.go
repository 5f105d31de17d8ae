package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"

	drv "github.com/go-sql-driver/mysql"

	mysqlstore "github.com/txoutbox/txoutbox/storage/mysql"
)

// mysqlDSNForm matches the driver's own DSN spelling behind mysql://, as
// golang-migrate writes it: user:password@tcp(host:3306)/db.
var mysqlDSNForm = regexp.MustCompile(`^([^/]*@)?(tcp|tcp4|tcp6|unix)\(`)

// mysqlConfig turns a mysql:// URL into the driver's configuration. Two
// spellings are accepted:
//
//	mysql://user:password@host:3306/db?tls=true      (a URL: percent-encode the password)
//	mysql://user:password@tcp(host:3306)/db?tls=true (the driver's DSN, as golang-migrate takes it)
//
// Query parameters are the driver's DSN parameters. Errors never quote the
// URL, so they cannot carry its password.
func mysqlConfig(raw string) (*drv.Config, error) {
	_, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return nil, usageError{"mysql URL: write mysql://user:password@host:3306/dbname"}
	}
	var cfg *drv.Config
	if mysqlDSNForm.MatchString(rest) {
		c, err := drv.ParseDSN(rest)
		if err != nil {
			return nil, usageError{fmt.Sprintf("mysql URL (driver DSN form): %v", redactErr(err))}
		}
		cfg = c
	} else {
		u, err := url.Parse(raw)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // url.Error quotes the URL
			}
			return nil, usageError{fmt.Sprintf("mysql URL: %v (write mysql://user:password@host:3306/dbname)", err)}
		}
		if u.Hostname() == "" {
			return nil, usageError{"mysql URL without a host: write mysql://user:password@host:3306/dbname"}
		}
		c := drv.NewConfig()
		c.Net, c.Addr = "tcp", u.Host
		if u.Port() == "" {
			c.Addr += ":3306"
		}
		c.User = u.User.Username()
		c.Passwd, _ = u.User.Password()
		c.DBName = strings.TrimPrefix(u.Path, "/")
		if u.RawQuery != "" {
			// The query holds the driver's parameters: let the driver read them.
			q, err := drv.ParseDSN("/?" + u.RawQuery)
			if err != nil {
				return nil, usageError{fmt.Sprintf("mysql URL parameters: %v", redactErr(err))}
			}
			q.User, q.Passwd, q.Net, q.Addr, q.DBName = c.User, c.Passwd, c.Net, c.Addr, c.DBName
			c = q
		}
		cfg = c
	}
	if cfg.DBName == "" {
		return nil, usageError{"mysql URL without a database name: write mysql://user:password@host:3306/dbname"}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	return cfg, nil
}

func openMySQL(ctx context.Context, o options) (*backend, error) {
	cfg, err := mysqlConfig(o.url)
	if err != nil {
		return nil, err
	}
	conn, err := drv.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("mysql URL: %w", redactErr(err))
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(4)
	s, err := mysqlstore.New(db, mysqlstore.Config{Table: o.table, HoldOnDeadLetter: o.hold})
	if err != nil {
		_ = db.Close()
		return nil, usageError{err.Error()}
	}
	pingCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("connect to MySQL at %s (database %s): %w", cfg.Addr, cfg.DBName, redactErr(err))
	}
	b := newBackend(s, db.Close)
	b.tableExists = func(ctx context.Context) (bool, error) {
		rows, err := db.QueryContext(ctx, "SELECT 1 FROM "+s.Table()+" LIMIT 0") //nolint:gosec // the storage's quoted table name, checked by mysql.New
		var me *drv.MySQLError
		if errors.As(err, &me) && me.Number == 1146 { // ER_NO_SUCH_TABLE
			return false, nil
		}
		if err != nil {
			return false, redactErr(err)
		}
		defer func() { _ = rows.Close() }()
		return true, redactErr(rows.Err())
	}
	return b, nil
}

// mysqlMigrations returns the steps for a table without connecting.
func mysqlMigrations(o options) (*mysqlstore.Storage, error) {
	db, err := sql.Open("mysql", "/unused") // never connected
	if err != nil {
		return nil, err
	}
	s, err := mysqlstore.New(db, mysqlstore.Config{Table: o.table})
	if err != nil {
		_ = db.Close()
		return nil, usageError{err.Error()}
	}
	return s, db.Close()
}
