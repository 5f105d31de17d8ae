package main

import (
	"errors"
	"strings"
	"testing"
)

func TestMySQLConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		url                      string
		user, pass, addr, dbName string
		tls                      string
	}{
		{"mysql://app:p%40ss@db.internal/orders", "app", "p@ss", "db.internal:3306", "orders", ""},
		{"mysql://app:pw@db:3307/orders?tls=skip-verify", "app", "pw", "db:3307", "orders", "skip-verify"},
		{"mysql://app:pw@tcp(db:3307)/orders?tls=preferred", "app", "pw", "db:3307", "orders", "preferred"},
		{"MYSQL://root@127.0.0.1:3306/test", "root", "", "127.0.0.1:3306", "test", ""},
	} {
		cfg, err := mysqlConfig(c.url)
		if err != nil {
			t.Errorf("mysqlConfig(%s): %v", c.url, err)
			continue
		}
		if cfg.User != c.user || cfg.Passwd != c.pass || cfg.Addr != c.addr || cfg.DBName != c.dbName || cfg.TLSConfig != c.tls {
			t.Errorf("mysqlConfig(%s) = user %q pass %q addr %q db %q tls %q", c.url, cfg.User, cfg.Passwd, cfg.Addr, cfg.DBName, cfg.TLSConfig)
		}
	}
	const secret = "Sup3rS3cret"
	for _, u := range []string{
		"mysql://app:" + secret + "@db.internal:3306/",
		"mysql://app:" + secret + "@/orders",
		"mysql://app:" + secret + "@db:port/orders",
		"mysql://app:" + secret + "@db/orders?timeout=forever",
		"mysql://app:" + secret + "@tcp(db:3306)/orders?timeout=forever",
	} {
		_, err := mysqlConfig(u)
		var ue usageError
		if !errors.As(err, &ue) {
			t.Errorf("mysqlConfig(%s) = %v, want a usage error", u, err)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("mysqlConfig(%s): the error quotes the password: %v", u, err)
		}
	}
}
