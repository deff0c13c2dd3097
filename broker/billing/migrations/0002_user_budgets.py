# Per-user monthly budgets (issue 13): UserBudget, and BudgetAlert.user (null = the team's alert).
# Written by hand: it depends on 0001_initial only (another change adds its own 0002; the lead merges them).
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0001_initial'),
        ('tenancy', '0002_team_quota_fair_share'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='UserBudget',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('monthly_budget_usd', models.DecimalField(decimal_places=2, max_digits=14)),
                ('updated_at', models.DateTimeField(auto_now=True)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='user_budgets',
                                             to='tenancy.tenant')),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='budgets',
                                           to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['tenant_id', 'user_id'],
                'constraints': [models.UniqueConstraint(fields=('tenant', 'user'), name='uniq_user_budget')],
            },
        ),
        migrations.RemoveConstraint(model_name='budgetalert', name='uniq_budget_alert'),
        migrations.AddField(
            model_name='budgetalert',
            name='user',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE,
                                    related_name='budget_alerts', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddConstraint(
            model_name='budgetalert',
            constraint=models.UniqueConstraint(condition=models.Q(user__isnull=True),
                                               fields=('tenant', 'month', 'threshold_pct'), name='uniq_budget_alert'),
        ),
        migrations.AddConstraint(
            model_name='budgetalert',
            constraint=models.UniqueConstraint(condition=models.Q(user__isnull=False),
                                               fields=('tenant', 'user', 'month', 'threshold_pct'),
                                               name='uniq_user_budget_alert'),
        ),
    ]
